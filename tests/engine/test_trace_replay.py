"""Routing traces and their replay: hand-computed LRU hit rates, the simulated predictor, and a
recorded live run whose replay reproduces the live cache counters exactly."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.store import ExpertStore
from moe_serve.engine.replay import load_trace, main, simulate
from moe_serve.engine.trace import RoutingRecorder


def _line(step: int, layer: int, experts: list[int], next_experts: list[int] | None = None) -> str:
    d = {"step": step, "pos": step, "layer": layer, "experts": experts, "probs": [0.5] * len(experts),
         "top_experts": experts + [9], "top_probs": [0.5] * len(experts) + [0.1]}
    if next_experts is not None:
        d.update(next_experts=next_experts, next_probs=[0.5] * len(next_experts))
    return json.dumps(d)


def _replay_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict]:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_lru_hit_rates_match_a_hand_computation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(_line(step, 0, [e]) for step, e in enumerate([0, 1, 0, 2, 1, 0])) + "\n")
    # 2 expert slots: m m h m(evict 1) m(evict 0) m(evict 2) -> 1/6; 3: m m h m h h -> 3/6
    results = _replay_json([str(trace), "--budget-experts", "2,3", "--policies", "lru", "--predictors", "none"], capsys)
    assert [(r["capacity"], r["hits"], r["misses"], r["evictions"]) for r in results] == [(2, 1, 5, 3), (3, 3, 3, 0)]
    assert results[0]["hit_rate"] == pytest.approx(1 / 6)
    assert results[0]["demand_experts"] == 5


def test_a_cyclic_scan_beats_lru_and_next_use_matches_the_optimum(tmp_path: Path) -> None:
    """Three layers, one expert each per forward, two expert slots: LRU (and MRS) evict what comes next
    and never hit. The optimum evicts the layer that just ran: after 3 cold misses every other run
    hits. Next-use does the same once its rates have settled (3 more misses in the first forwards)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(_line(step, layer, [0]) for step in range(10) for layer in range(3)) + "\n")
    loaded = load_trace(trace)
    misses = {policy: simulate(loaded, capacity=2, policy=policy, predictor="none").snapshot().total().misses
              for policy in ("lru", "mrs", "next-use", "opt")}
    assert misses == {"lru": 30, "mrs": 30, "next-use": 19, "opt": 16}


def test_verify_windows_merge_decode_steps_and_drop_prefills(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    prefill = [json.dumps({**json.loads(_line(0, layer, [7])), "pos": pos}) for pos in range(3) for layer in (0, 1)]
    decode = [_line(step, layer, [step + layer]) for step in range(1, 6) for layer in (0, 1)]
    second_prefill = [json.dumps({**json.loads(_line(6, 0, [7])), "pos": pos}) for pos in range(2)]
    trace.write_text("\n".join(prefill + decode + second_prefill + [_line(7, 0, [3])]) + "\n")
    windows = load_trace(trace, verify_tokens=2)
    # decode steps 1..5 -> windows {1,2} {3,4} {5}; step 7 starts a new window after the prefill
    assert [(r.layer, r.experts) for r in windows.runs] == [
        (0, [1, 2]), (1, [2, 3]), (0, [3, 4]), (1, [4, 5]), (0, [5]), (1, [6]), (0, [3])]
    assert windows.tokens == 6
    plain = load_trace(trace, verify_tokens=1)
    assert len(plain.runs) == 11 and plain.tokens == 6
    assert load_trace(trace).tokens == 11  # everything, prefills included


def test_simulated_predictor_prefetches_its_guess(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    layer1 = [3, 4, 5, 6]
    lines = [line for step, e in enumerate(layer1) for line in (_line(step, 0, [0], [e]), _line(step, 1, [e]))]
    trace.write_text("\n".join(lines) + "\n")
    loaded = load_trace(trace)
    assert (loaded.num_layers, loaded.num_experts, len(loaded.runs)) == (2, 10, 8)
    off = simulate(loaded, capacity=4, policy="lru", predictor="none").snapshot().per_layer[1]
    on = simulate(loaded, capacity=4, policy="lru", predictor="next-layer").snapshot().per_layer[1]
    assert (off.hits, off.misses) == (0, 4)
    assert (on.hits, on.misses, on.prefetch_used, on.predictor_accuracy) == (4, 0, 4, 1.0)


def test_cli_prints_a_table_per_slots_per_layer(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(_line(s, layer, [s % 3]) for s in range(4) for layer in range(2)) + "\n")
    out = subprocess.run([sys.executable, "-m", "moe_serve.engine.replay", str(trace), "--slots-per-layer", "1,2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].split()[:4] == ["policy", "predictor", "slots", "hit"]
    assert len(out) == 1 + 2 * 5 * 2  # capacities x policies (opt included) x predictors
    assert {line.split()[2] for line in out[1:]} == {"2", "4"}  # expert slots per layer x 2 layers


@pytest.mark.parametrize("policy", ["lru", "mrs", "next-use"])
def test_replay_of_a_recorded_live_run_reproduces_its_counters(tmp_path: Path, policy: str) -> None:
    layers, experts, hidden, top_k = 3, 8, 8, 2
    layout = ExpertLayout(hidden_size=hidden, intermediate_size=4, dtype=torch.float32)
    store = ExpertStore(layers, experts, layout)
    gen = torch.Generator().manual_seed(0)
    store.rows.copy_(torch.randn(store.rows.shape, generator=gen))
    routers = [torch.randn(experts, hidden, generator=gen) for _ in range(layers)]
    path = tmp_path / "routing.jsonl"
    with RoutingRecorder(path, top_k) as recorder:
        runner = CachedExpertRunner(store, 5 * layout.nbytes, policy, "cpu", top_k=top_k, observer=recorder)
        runner.set_router_weights(routers)
        start = 0
        for tokens in (4, 1, 1, 3, 1, 1):  # a prefill, decodes and a verify span: waves included
            recorder.begin_forward(range(start, start + tokens))
            x = torch.randn(tokens, hidden, generator=gen)  # [T, H]
            for layer in range(layers):
                probs = (x @ routers[layer].T).softmax(-1)  # [T, E]
                weights, ids = probs.topk(top_k, dim=-1)
                runner.run(x, LayerRouting(layer, ids, weights, probs))
            start += tokens
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 11 * layers
    assert lines[layers * 4]["pos"] == 4 and lines[layers * 4]["step"] == 1
    assert "next_experts" in lines[0] and all("next_experts" not in d for d in lines if d["layer"] == layers - 1)
    live = runner.stats().per_layer
    replayed = simulate(load_trace(path), 5, policy, "none").snapshot().per_layer
    fields = ("hits", "misses", "evictions", "waves")
    assert [[getattr(s, f) for f in fields] for s in replayed] == [[getattr(s, f) for f in fields] for s in live]
    assert sum(s.waves for s in live) > 6 * layers  # the 4-token prefill needed more than one wave
