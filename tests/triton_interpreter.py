"""Run a test module's check under Triton's interpreter, for the kernels' CPU tests.

TRITON_INTERPRET=1 is read when triton is first imported, so it cannot be switched on inside the
pytest process (other tests have imported triton already): the check runs in a subprocess that
imports the test module by its file name and calls one of its functions.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_interpreted(test_file: str, call: str, timeout: float = 300) -> None:
    """Call `call` (e.g. "check_interpreted([...])") of the test module at `test_file` with
    TRITON_INTERPRET=1; fails with the subprocess's stderr if it raises."""
    module = Path(test_file)
    path = os.pathsep.join(filter(None, [str(ROOT), str(module.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", f"import {module.stem} as t; t.{call}"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
