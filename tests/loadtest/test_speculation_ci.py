"""Speculative decoding served to concurrent clients through the real server (CPU, fp32, tiny
model, --spec self, --spec-switch always so that its timings on a busy 2-core machine never make it
decode plainly throughout): every streamed answer equals its solo reference token for token (exact), the
server's counters show draft/verify rounds during the level, and the server exits cleanly. The
engine-level proof that a speculating batch changes no greedy answer is
tests/engine/speculative/test_batched.py; this is the same path behind HTTP, SSE and the engine process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.run import main


def test_speculating_server_answers_every_client_exactly(tiny_model: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned server inherits it: no thread pool spinning on 2 cores
    out = tmp_path / "spec.json"
    code = main(["--spawn", "--model", str(tiny_model), "--server-log", str(tmp_path / "moe_serve.server.log"),
                 "--server-args", "--device cpu --max-model-len 256 --spec self --spec-switch always --spec-tokens 3",
                 "--concurrency", "4", "--requests", "24", "--num-prompts", "8", "--prompt-words", "6",
                 "--max-tokens", "24", "--client-processes", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert code == 0, report["verdict"]
    assert level["requests"] == level["completed"] == 24 and level["wrong_answers"] == 0
    view = level["server_view"]
    assert view["spec_verify_rounds"] > 0 and view["spec_acceptance"] is not None, view
    assert report["server"]["exit_code_after_sigterm"] == 0
