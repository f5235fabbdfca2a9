"""Run a test module's check under Triton's interpreter, for the kernels' CPU tests.

TRITON_INTERPRET=1 is read when triton is first imported, so it cannot be switched on inside the
pytest process (other tests have imported triton already): the checks run in a worker process
started with it, which imports each test module by its file name and calls one of its functions.
One worker serves the whole session (torch and triton take ~3 s to import, and ~90 checks ran a
process each: ~4 minutes of CI); a check that crashes it or runs past its timeout ends it, and
the next check starts another. Checks share the worker's modules, so one that patches a module
restores it before returning.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# The worker: one JSON request a line on stdin ({"file", "call"}), one JSON reply a line on the
# stdout it started with ({"error": traceback or null}); what the checks print goes to stderr.
WORKER = r"""
import importlib.util, json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    try:
        path = os.path.abspath(request["file"])
        folder, stem = os.path.split(path)
        stem = stem.removesuffix(".py")
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module = sys.modules.get(stem)
        if module is None or os.path.abspath(module.__file__) != path:
            assert module is None, f"two test modules named {stem}: {module.__file__} and {path}"
            spec = importlib.util.spec_from_file_location(stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[stem] = module
            spec.loader.exec_module(module)
        eval("module." + request["call"], {"module": module})
        error = None
    except BaseException:
        error = traceback.format_exc()
    replies.write(json.dumps({"error": error}) + "\n")
    replies.flush()
"""


class _Worker:
    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # the worker's stderr: read back when it dies
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log,
                                        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path})

    def call(self, test_file: str, call: str, timeout: float) -> str | None:
        """The check's traceback, or None if it passed. Raises TimeoutError or EOFError (the worker is then unusable)."""
        self.process.stdin.write(json.dumps({"file": test_file, "call": call}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{call} ran past {timeout} s")
        line = self.process.stdout.readline()
        if not line:
            raise EOFError(f"the interpreter process died during {call}")
        return json.loads(line)["error"]

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


_worker: _Worker | None = None


def _close_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


atexit.register(_close_worker)


def run_interpreted(test_file: str, call: str, timeout: float = 300) -> None:
    """Call `call` (e.g. "check_interpreted([...])") of the test module at `test_file` with
    TRITON_INTERPRET=1; fails with the check's traceback if it raises."""
    global _worker
    if _worker is None:
        _worker = _Worker()
    try:
        error = _worker.call(test_file, call, timeout)
    except (TimeoutError, EOFError) as died:
        tail = _worker.stderr_tail()
        _close_worker()
        pytest.fail(f"{died}\n{tail}")
    except BaseException:  # interrupted (pytest-timeout, ^C) mid-check: its reply would answer the next one
        _close_worker()
        raise
    assert error is None, error[-4000:]
