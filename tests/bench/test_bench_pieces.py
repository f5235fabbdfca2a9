"""The benchmark's own arithmetic: the floor's byte count, accelerate's offloaded bytes, the cutoff
verdict and the report's handling of failed rows (CPU, tiny checkpoints)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.baselines import offloaded_bytes
from bench.cutoff_sweep import verdict
from bench.floor import Bandwidths, StepBytes, floor_seconds, step_bytes
from bench.report import markdown
from bench.rows import RowResult, failed_row
from bench.step_profile import STEP, merged, summarize
from moe_serve.engine.speculative.switch import SpecSwitch
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_hf_model


def test_step_bytes_counts_active_experts_and_one_embedding_row(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("olmoe", tmp_path / "olmoe")  # untied: lm_head and embed_tokens
    hf = tiny_hf_model("olmoe")
    cfg = hf.config
    params = dict(hf.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    embed = params["model.embed_tokens.weight"].numel()
    step = step_bytes(path, torch.bfloat16, context_tokens=10)
    expert = 3 * cfg.hidden_size * cfg.intermediate_size * 2
    assert step.expert_bytes == expert
    assert step.all_experts == experts * 2
    assert step.active_experts == cfg.num_hidden_layers * cfg.num_experts_per_tok * expert
    assert step.non_expert == (sum(p.numel() for p in params.values()) - experts - embed + cfg.hidden_size) * 2
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert step.kv == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 10


def test_floor_is_the_slower_of_hbm_and_pcie() -> None:
    step = StepBytes(non_expert=600, active_experts=400, kv=0, expert_bytes=100, all_experts=800)
    bw = Bandwidths(hbm_bytes_per_s=1000.0, h2d_bytes_per_s=100.0, h2d_buffer_bytes=100)
    assert floor_seconds(step, 50.0, bw) == {"floor_s": 1.0, "hbm_s": 1.0, "pcie_s": 0.5, "bound": "hbm"}
    assert floor_seconds(step, 300.0, bw)["bound"] == "pcie"


def test_offloaded_bytes_follow_the_longest_prefix() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)))
    device_map = {"": 0, "1": "cpu", "1.1": 0}
    assert offloaded_bytes(model, device_map) == (4 * 2 + 2) * 4  # only 1.0's weight and bias


def _row(name: str, tpot: float) -> RowResult:
    return RowResult(name, tpot, tpot, 0.1, 8)


@pytest.mark.parametrize(("tpots", "u_shaped", "best"), [
    ([3.0, 2.0, 1.0, 2.0], True, 2),
    ([1.0, 1.5, 2.0, 3.0], False, 0),
])
def test_cutoff_verdict(tpots: list[float], u_shaped: bool, best: int) -> None:
    rows = [_row(f"cutoff={c}", t) for c, t in enumerate(tpots)]
    v = verdict(rows, num_moe_layers=3, auto_cutoff=best)
    assert (v["u_shaped"], v["best_cutoff"], v["auto_within_10pct"]) == (u_shaped, best, True)
    v = verdict(rows, num_moe_layers=3, auto_cutoff=max(range(4), key=lambda c: tpots[c]))  # the worst
    assert v["auto_within_10pct"] is False and v["auto_over_best"] == max(tpots) / min(tpots)


def test_markdown_keeps_errors_and_skips_visible() -> None:
    rows = [failed_row("a", {"error": "RuntimeError('boom')"}), failed_row("b", {"skipped": "no draft"})]
    text = markdown({"title": "t", "command": "c", "rows": [r.as_dict() for r in rows], "ratios": {}})
    assert "ERROR: RuntimeError('boom')" in text and "skipped: no draft" in text


class AlwaysSpeculate(SpecSwitch):
    def speculate(self, batch: int) -> bool:
        return True

    def prefers(self, batch: int) -> bool:
        return True


def test_spec_arrivals_closed_loop_keeps_its_clients_and_counts_rounds_with_prefills(tmp_path: Path) -> None:
    from bench.spec_arrivals import ClosedLoop
    from moe_serve.engine.config import EngineConfig
    from moe_serve.engine.core import EngineCore

    path = build_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    core = EngineCore(EngineConfig(model=str(path), max_model_len=128, spec="self", spec_tokens=3))
    core.spec_switch = AlwaysSpeculate()  # the measured choice (test_switch.py) may pick plain on a CPU
    prompts = [[5 + i, 9, 17 + i, 4] for i in range(4)]
    try:
        loop = ClosedLoop(core, prompts)
        old, new = loop.run(False, 2, 5, "old"), loop.run(True, 2, 5, "new")
    finally:
        core.close()
    assert old["tokens"] == new["tokens"] == 5 * 64
    assert old["rounds_with_riders"] == 0 < new["rounds_with_riders"]


def test_step_profile_sums_kernels_per_step_and_the_gpus_busy_union() -> None:
    assert merged([(20, 25), (0, 10), (5, 12), (21, 22), (25, 30)]) == [(0, 12), (20, 30)]
    kernel = {"cat": "kernel", "name": "_down_kernel"}
    step = {"cat": "user_annotation"}
    events = [{**step, "name": f"{STEP}0", "ts": 0, "dur": 100}, {**step, "name": f"{STEP}1", "ts": 100, "dur": 50},
              {"cat": "gpu_user_annotation", "name": f"{STEP}1", "ts": 105, "dur": 60},  # the GPU's copy of a range
              {**kernel, "ts": 10, "dur": 30}, {**kernel, "ts": 20, "dur": 30},  # overlapping: busy 40
              {**kernel, "ts": 80, "dur": 10},  # after 30 us idle
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 110, "dur": 20},
              {**kernel, "ts": 140, "dur": 40},  # launched in step 1, running past its end
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 4},  # the host's calls
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 15, "dur": 3},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60, "dur": 20},
              {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 105, "dur": 2}]
    summary = summarize(events, walls=[100e-6, 50e-6])
    assert summary["steps"][0] == {"wall_ms": 0.1, "gpu_busy_ms": 0.05, "gpu_idle_ms": pytest.approx(0.05),
                                   "h2d_ms": 0.0, "h2d_copies": 0, "idle_gaps_us": [(50, 30)],
                                   "runtime_calls": {"cudaStreamSynchronize": {"count": 1, "us": 20},
                                                     "cudaLaunchKernel": {"count": 2, "us": 7}}}
    assert summary["steps"][1]["runtime_calls"] == {"cudaMemcpyAsync": {"count": 1, "us": 2}}
    assert summary["steps"][1]["h2d_ms"] == 0.02 and summary["steps"][1]["h2d_copies"] == 1
    assert summary["steps"][1]["gpu_busy_ms"] == 0.06
    assert summary["steps"][1]["idle_gaps_us"] == []  # 130 -> 140: 10 us, under MIN_GAP_US
    assert summary["mean_us_per_step"] == [{"name": "_down_kernel", "us": 55.0},
                                           {"name": "Memcpy HtoD (Pinned -> Device)", "us": 10.0}]
