"""Run moe-serve / moe-generate as a user would (a subprocess) and check how a start-up failure reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "moe_serve" / "models" / "default"
MODULES = {"moe-serve": "moe_serve.server", "moe-generate": "moe_serve.engine.cli"}


def run_cli(program: str, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", MODULES[program], *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOE_ARG_")}
    return subprocess.run(cmd, cwd=REPO, env={**environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_failure(result: subprocess.CompletedProcess[str], program: str, *fragments: str) -> None:
    """A non-zero exit, no traceback, and stderr one line naming the program and each fragment."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{program}: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def model_without_tokenizer(folder: Path) -> Path:
    """The default model's config and weights, linked, and no tokenizer files."""
    folder.mkdir()
    for file in DEFAULT_MODEL.iterdir():
        if file.name == "config.json" or "safetensors" in file.name:
            (folder / file.name).symlink_to(file)
    return folder


def unsupported_model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder
