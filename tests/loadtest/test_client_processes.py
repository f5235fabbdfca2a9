"""A level's clients spread over client processes: the split arithmetic, and a level run in two
processes against a spawned server, merged and verified as one."""
from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import pytest

from loadtest.run import (
    Divergence,
    Mix,
    Result,
    client_process_count,
    client_shares,
    main,
    make_prompts,
    request_indices,
)


@pytest.mark.parametrize("flag, concurrency, cpus, processes", [
    ("auto", 1, 16, 1), ("auto", 4, 16, 1), ("auto", 5, 16, 2), ("auto", 8, 16, 2), ("auto", 32, 16, 8),
    ("auto", 64, 16, 8), ("auto", 256, 16, 8),  # at most half the cores
    ("auto", 64, 2, 1), ("auto", 64, 1, 1), ("auto", 64, None, 1),  # at least 1
    (1, 64, 16, 1), (5, 64, 2, 5), (5, 3, 16, 3),  # as asked, but never more than the clients
])
def test_how_many_client_processes(flag: int | str, concurrency: int, cpus: int | None, processes: int) -> None:
    assert client_process_count(flag, concurrency, cpus) == processes


@pytest.mark.parametrize("concurrency, processes", [(1, 1), (8, 1), (32, 4), (64, 8), (10, 3), (7, 7), (65, 8)])
def test_shares_cover_the_clients_as_evenly_as_possible(concurrency: int, processes: int) -> None:
    shares = client_shares(concurrency, processes)
    assert len(shares) == processes and [j for share in shares for j in share] == list(range(concurrency))
    assert min(map(len, shares)) >= 1 and max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("concurrency, processes, requests, counts", [
    (10, 3, 100, [40, 30, 30]), (10, 3, 7, [4, 3, 0]), (64, 8, 100, [16, 16, 16, 16, 12, 8, 8, 8]), (4, 1, 9, [9])])
def test_each_request_is_sent_by_one_share_in_proportion(concurrency: int, processes: int, requests: int,
                                                          counts: list[int]) -> None:
    shares = client_shares(concurrency, processes)
    per_share = [list(request_indices(share, concurrency, requests)) for share in shares]
    assert sorted(j for indices in per_share for j in indices) == list(range(requests))
    assert [len(indices) for indices in per_share] == counts
    # the first `concurrency` requests, in flight together, are one per client
    assert [sum(j < concurrency for j in indices) for indices in per_share] == \
        [len(range(share.start, min(share.stop, requests))) for share in shares]


def test_without_a_request_count_a_share_sends_until_stopped() -> None:
    indices = request_indices(range(2, 4), 4, None)
    assert [next(indices) for _ in range(4)] == [2, 3, 6, 7]


def test_a_result_survives_the_trip_from_a_client_process() -> None:
    result = Result(3, "raw", 1.0, 2.0, "ok", 0.1, 0.5, [0.01, 0.02], 5, 4, 0.0, "", ["a problem"],
                    Divergence(1, "B", "b"))
    assert pickle.loads(pickle.dumps(result)) == result


def test_a_level_in_two_client_processes(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merged, the two processes' results are the level's requests, each sent as one process would plan it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned server inherits it: no thread pool spinning on 2 cores
    concurrency, requests, seed = 4, 16, 0
    out = tmp_path / "report.json"
    code = main(["--spawn", "--model", str(tiny_model), "--server-log", str(tmp_path / "moe_serve.server.log"),
                 "--server-args", "--device cpu --max-model-len 256", "--concurrency", str(concurrency),
                 "--requests", str(requests), "--num-prompts", "8", "--prompt-words", "6", "--max-tokens", "8",
                 "--raw-fraction", "0.25", "--client-processes", "2", "--seed", str(seed), "--out", str(out)])
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert code == 0, report["verdict"]
    assert level["client_processes"] == 2
    assert level["requests"] == level["completed"] == requests and level["wrong_answers"] == 0
    assert level["warmup"]["requests"] == concurrency and level["warmup"]["wrong_answers"] == 0
    prompts, mix = make_prompts(8, 6, 8, 0.5, seed), Mix(0.25, 0.0, seed + concurrency)  # as run_level makes them
    planned = Counter("raw" if mix.plan(j, prompts, [])[1] else "sdk" for j in range(requests))
    assert level["via_counts"] == dict(planned)
    busy = level["resources"]["cpu_busy"]
    assert busy["client"] > 0 and busy["engine"] > 0, busy
