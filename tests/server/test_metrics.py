from prometheus_client.parser import text_string_to_metric_families

from engine.messages import MetricsSnapshot
from server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_speculative_counters_are_exported_per_position_layer_and_phase():
    metrics = ServerMetrics()
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
    metrics = ServerMetrics()
    metrics.on_snapshot(MetricsSnapshot(spec_accepted_at_position=(3, 1), spec_draft_seconds=0.5))
    metrics.engine.engine_lost()
    metrics.on_snapshot(MetricsSnapshot(spec_accepted_at_position=(2, 2, 1), spec_draft_seconds=0.25))
    samples = _samples(metrics)
    assert [samples[("moe_spec_accepted_at_position_total", (("position", str(i)),))] for i in range(3)] == [5, 3, 1]
    assert samples[("moe_spec_phase_seconds_total", (("phase", "draft"),))] == 0.75
