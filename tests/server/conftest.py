"""Real servers for the HTTP tests: a tiny checkpoint + tokenizer on disk, `python -m moe_serve.server` on a
free port, on the CPU. One shared server per session; tests that need other flags start their own."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from moe_serve.server.harmony import Harmony, load_encoding
from moe_serve.server.tokenizer import Tokenizer
from tests.server.harmony_tokenizer import build_gpt_oss_tokenizer, use_bundled_vocabulary
from tests.server.tiny_tokenizer import build_tiny_tokenizer
from tests.tiny_checkpoints import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
FAMILY = "mixtral"
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 240
DEFAULT_MODEL = REPO / "moe_serve" / "models" / "default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path
    model: str  # the served model name
    model_dir: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        """Engine processes in start order, as the server logs them (no endpoint tells)."""
        return [int(p) for p in re.findall(r"engine process started \(pid (\d+)\)", self.log())]

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=60, **kwargs)

    def metric(self, line_prefix: str, headers: dict | None = None) -> float:
        """The value of the first /metrics sample line that starts with line_prefix."""
        for line in self.get("/metrics", headers=headers or {}).text.splitlines():
            if line.startswith((line_prefix + " ", line_prefix + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(line_prefix)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if self.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(model_dir: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 module: str = "moe_serve.server") -> RunningServer:
    """Start `python -m moe_serve.server` (or another module taking its flags) and wait until /health says
    the engine is ready."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", module, "--model", str(model_dir), "--device", "cpu", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), *args]
    # One intra-op thread: on a small shared CPU torch's default thread pool spins against the
    # other processes (measured: ~70x slower per step on 2 busy cores).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path, model_dir.name, model_dir)
    try:
        server.wait_healthy()
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny-moe"
    build_tiny_checkpoint(FAMILY, path)
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def default_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The embedded default model (a real tokenizer and trained weights), for tests that compare
    against it scored directly with transformers."""
    running = start_server(DEFAULT_MODEL, tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def hermes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The embedded default model with its tool-call parser (hermes: tool_choice "auto" is served) and room
    for tool schemas in the prompt: the client-library tests and the tool-calling tests share it."""
    running = start_server(DEFAULT_MODEL, tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                           "--tool-call-parser", "hermes")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def harmony() -> Harmony:
    """gpt-oss's harmony format over the vocabulary litellm bundles (no network needed)."""
    use_bundled_vocabulary()
    return Harmony(load_encoding())


@pytest.fixture(scope="session")
def gpt_oss_tokenizer_dir(harmony: Harmony, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss's o200k_harmony tokenizer files, built once a session (about 4 s)."""
    path = tmp_path_factory.mktemp("gpt-oss-tokenizer")
    build_gpt_oss_tokenizer(path, harmony.encoding)
    return path


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    """The OpenAI SDK pointed at the tiny-model server; no retries, so a failure shows as it happened."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server: RunningServer) -> Tokenizer:
    return Tokenizer(str(server.model_dir))
