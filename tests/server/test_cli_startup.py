"""moe-serve start-up failures: each is one line on stderr and a non-zero exit, never a traceback,
and each is found before any weights load (the port included)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tests.cli_runs import REPO, assert_one_line_failure, model_without_tokenizer, run_cli, unsupported_model
from tests.gguf_checkpoints import gguf_pair

PRESET = REPO / "moe_serve" / "configs" / "qwen3-30b-a3b-16gb.yaml"


def test_missing_folder() -> None:
    assert_one_line_failure(run_cli("moe-serve", "/no/such/model"), "moe-serve", "/no/such/model", "no such folder")


def test_hub_id_is_refused_with_how_to_download() -> None:
    result = run_cli("moe-serve", "Qwen/Qwen3-30B-A3B")
    assert_one_line_failure(result, "moe-serve", "download it first", "hf download Qwen/Qwen3-30B-A3B --local-dir")


def test_empty_folder(tmp_path: Path) -> None:
    assert_one_line_failure(run_cli("moe-serve", "--model", str(tmp_path)), "moe-serve", "is empty")


def test_unsupported_architecture(tmp_path: Path) -> None:
    result = run_cli("moe-serve", str(unsupported_model(tmp_path / "gpt2")))
    assert_one_line_failure(result, "moe-serve", "GPT2LMHeadModel", "supported: ")


def test_no_tokenizer_files(tmp_path: Path) -> None:
    result = run_cli("moe-serve", str(model_without_tokenizer(tmp_path / "bare")))
    assert_one_line_failure(result, "moe-serve", "no tokenizer files", "--tokenizer")


def test_a_gguf_tokenizer_transformers_cannot_build_asks_for_the_tokenizer_folder(tmp_path: Path) -> None:
    gguf_file, _ = gguf_pair("deepseek_v2", tmp_path, moe_intermediate_size=32)  # transformers reads no deepseek2
    result = run_cli("moe-serve", str(gguf_file), "--port", "0", env={"MOE_SERVE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-serve: cannot load the tokenizer in") and "deepseek2" in last, last
    assert last.endswith("give the checkpoint's tokenizer folder as --tokenizer DIR"), last


def test_port_in_use_is_found_before_loading() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("moe-serve", "--port", str(port))
    assert_one_line_failure(result, "moe-serve", f"port {port}", "already in use")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_but_absent() -> None:
    assert_one_line_failure(run_cli("moe-serve", "--device", "cuda"), "moe-serve", "--device cuda", "--device cpu")


def test_preset_without_its_model() -> None:
    result = run_cli("moe-serve", "--config", str(PRESET))
    assert_one_line_failure(result, "moe-serve", "names no model", "moe-serve DIR --config")


def test_max_model_len_beyond_the_model() -> None:
    result = run_cli("moe-serve", "--max-model-len", "4096")
    assert_one_line_failure(result, "moe-serve", "4096", "1024")


def test_model_from_the_environment_is_checked_too() -> None:
    result = run_cli("moe-serve", env={"MOE_ARG_MODEL": "/no/such/env-model"})
    assert_one_line_failure(result, "moe-serve", "/no/such/env-model")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_send_without_nagle(host: str) -> None:
    """uvicorn serves the listener bind_listener made; asyncio sets TCP_NODELAY on what it accepts only
    when the listener names its protocol. Without it a kept-alive request's response waited ~40 ms."""
    import asyncio

    from moe_serve.server.cli import bind_listener

    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        try:
            listener = bind_listener(host, 0)
        except Exception as exc:  # noqa: BLE001 - a host without a loopback of this family
            pytest.skip(f"cannot listen on {host}: {exc}")
        server = await asyncio.start_server(on_connect, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(host, listener.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
