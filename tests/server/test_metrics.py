import time

from prometheus_client.parser import text_string_to_metric_families

from moe_serve.engine.messages import MetricsSnapshot
from moe_serve.server.metrics import FINISH_REASONS, ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_speculative_counters_are_exported_per_position_layer_and_phase():
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(MetricsSnapshot(spec_verify_steps=4, spec_accepted_at_position=(3, 1),
                                        spec_needed_per_layer=(5, 6), spec_predicted_needed_per_layer=(4, 2),
                                        spec_draft_seconds=0.5, spec_verify_seconds=1.5))
    samples = _samples(metrics)
    assert samples[("moe_spec_verify_steps_total", ())] == 4
    assert samples[("moe_spec_accepted_at_position_total", (("position", "1"),))] == 1
    assert samples[("moe_spec_needed_experts_total", (("layer", "1"),))] == 6
    assert samples[("moe_spec_predicted_experts_total", (("layer", "0"),))] == 4
    assert samples[("moe_spec_phase_seconds_total", (("phase", "verify"),))] == 1.5


def test_a_restarted_engine_keeps_counting_from_what_the_lost_one_had():
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(MetricsSnapshot(spec_accepted_at_position=(3, 1), spec_draft_seconds=0.5))
    metrics.engine.engine_lost()
    metrics.on_snapshot(MetricsSnapshot(spec_accepted_at_position=(2, 2, 1), spec_draft_seconds=0.25))
    samples = _samples(metrics)
    assert [samples[("moe_spec_accepted_at_position_total", (("position", str(i)),))] for i in range(3)] == [5, 3, 1]
    assert samples[("moe_spec_phase_seconds_total", (("phase", "draft"),))] == 0.75


def test_the_experts_format_and_bytes_per_expert_are_exported():
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(MetricsSnapshot(expert_format="q4_k", expert_bytes=1_234_567))
    metrics.engine.engine_lost()  # a gauge: the next engine's own value, not a sum
    metrics.on_snapshot(MetricsSnapshot(expert_format="q4_k", expert_bytes=1_234_567))
    samples = _samples(metrics)
    assert samples[("moe_expert_format_info", (("format", "q4_k"),))] == 1
    assert samples[("moe_expert_bytes", ())] == 1_234_567


# The same observations under our name and vLLM's: (moe_ sample, vllm: sample)
SAME_VALUE = (
    ("moe_prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("moe_generation_tokens_total", "vllm:generation_tokens_total"),
    ("moe_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
    ("moe_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
    ("moe_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
    ("moe_e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
    ("moe_time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_count"),
    ("moe_time_per_output_token_seconds_sum", "vllm:inter_token_latency_seconds_sum"),
    ("moe_time_per_output_token_seconds_count", "vllm:time_per_output_token_seconds_count"),
    ("moe_batch_tokens_count", "vllm:iteration_tokens_total_count"),
    ("moe_num_requests_running", "vllm:num_requests_running"),
    ("moe_num_requests_waiting", "vllm:num_requests_waiting"),
    ("moe_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
    ("moe_preemptions_total", "vllm:num_preemptions_total"),
    ("moe_spec_drafts_total", "vllm:spec_decode_num_drafts_total"),
    ("moe_spec_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    ("moe_spec_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
) + tuple((("moe_requests_total", (("finish_reason", r),)), ("vllm:request_success_total", (("finished_reason", r),)))
          for r in FINISH_REASONS)


def _vllm_view(text: str, model: str) -> tuple[dict, dict]:
    """(moe_ samples, vllm: samples), both keyed (name, other labels); every vllm: sample must carry
    vLLM's model_name and engine labels."""
    ours, theirs = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            if s.name.startswith("vllm:"):
                assert (labels.pop("model_name"), labels.pop("engine")) == (model, "0"), s
                theirs[(s.name, tuple(sorted(labels.items())))] = s.value
            elif s.name.startswith("moe_"):
                ours[(s.name, tuple(sorted(labels.items())))] = s.value
    return ours, theirs


def _key(name: str | tuple) -> tuple:
    return name if isinstance(name, tuple) else (name, ())


def _assert_same(ours: dict, theirs: dict) -> None:
    for moe, vllm in SAME_VALUE:
        assert ours[_key(moe)] == theirs[_key(vllm)], (moe, vllm)


def test_vllm_names_carry_the_same_values_as_the_moe_names():
    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(MetricsSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.25, preemptions=3,
                                        spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=7,
                                        spec_accepted_at_position=(4, 2, 1), tpot_samples=(0.004, 0.03),
                                        batch_token_samples=(9, 1)))
    metrics.ttft.observe(0.2)
    metrics.e2e.observe(1.2)
    metrics.prompt_tokens.inc(9)
    metrics.generation_tokens.inc(5)
    metrics.requests["length"].inc()
    ours, theirs = _vllm_view(metrics.render().decode(), "tiny")
    _assert_same(ours, theirs)
    assert theirs[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 1
    assert theirs[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert theirs[("vllm:kv_cache_usage_perc", ())] == 0.25
    # vLLM's buckets, not ours: 4 ms is under vLLM's first inter-token bucket (10 ms)
    assert theirs[("vllm:inter_token_latency_seconds_bucket", (("le", "0.01"),))] == 1
    assert ours[("moe_time_per_output_token_seconds_bucket", (("le", "0.005"),))] == 1


def _quiet_scrape(server) -> str:
    """A /metrics text once the engine is idle and two scrapes agree (snapshots arrive twice a second)."""
    previous = None
    for _ in range(40):
        text = server.get("/metrics").text
        if text == previous and server.metric("moe_num_requests_running") == 0:
            return text
        previous = text
        time.sleep(0.6)
    raise TimeoutError("/metrics kept changing with no request in flight")


def test_a_request_moves_the_vllm_series_with_the_moe_series(server):
    before, _ = _vllm_view(_quiet_scrape(server), server.model)
    chat = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 6, "seed": 1,
                                                     "messages": [{"role": "user", "content": "hello"}]})
    completion = server.post("/v1/completions", json={"model": server.model, "prompt": "def f(", "max_tokens": 5,
                                                      "n": 2, "seed": 2, "stream": True})
    assert chat.status_code == completion.status_code == 200
    ours, theirs = _vllm_view(_quiet_scrape(server), server.model)
    _assert_same(ours, theirs)

    def moved(name: str | tuple) -> float:
        return ours[_key(name)] - before[_key(name)]

    # the chat's tokens and at least one per streamed choice
    assert moved("moe_generation_tokens_total") >= chat.json()["usage"]["completion_tokens"] + 2
    assert sum(moved(moe) for moe, _ in SAME_VALUE if moe[0] == "moe_requests_total") == 3  # choices
    assert moved("moe_time_to_first_token_seconds_count") == 2  # one per HTTP request
