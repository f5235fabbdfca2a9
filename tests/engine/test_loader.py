"""The loader fails loudly, naming the tensor, on any checkpoint that does not match its config;
sharded checkpoints load the same weights as single-file ones."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import LoadedModel, LoadError, load_model, resolve_dtype
from tests.tiny_checkpoints import AllResidentRunner, build_tiny_checkpoint

Tensors = dict[str, torch.Tensor]


def _load(path: Path, dtype: torch.dtype | None = None) -> LoadedModel:
    return load_model(path, dtype=dtype, runner_factory=AllResidentRunner.factory, progress=False)


def _edit(path: Path, edit: Callable[[Tensors], None]) -> Path:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _logits(loaded: LoadedModel) -> torch.Tensor:
    kv = KVCache.for_model(loaded.config, 16, device="cpu", dtype=loaded.model.dtype)
    return loaded.model(torch.arange(3, 13), 0, kv).float()


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("ckpt") / "qwen2_moe")


@pytest.fixture
def copy(qwen2_moe: Path, tmp_path: Path) -> Path:
    for file in qwen2_moe.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.k_proj.bias",
    "model.layers.2.mlp.experts.5.up_proj.weight",
    "model.layers.0.mlp.shared_expert_gate.weight",
    "lm_head.weight",
])
def test_missing_tensor_is_named(copy: Path, name: str) -> None:
    _edit(copy, lambda t: t.pop(name))
    with pytest.raises(LoadError, match=f"missing tensors? .*{name.replace('.', '[.]')}"):
        _load(copy)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.mlp.experts.0.up_proj.weight"])
def test_unexpected_tensor_is_named(copy: Path, name: str) -> None:
    # the second is an expert of layer 1, which mlp_only_layers makes dense
    _edit(copy, lambda t: t.__setitem__(name, torch.zeros(4)))
    with pytest.raises(LoadError, match=f"unexpected tensor '{name.replace('.', '[.]')}'"):
        _load(copy)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"])
def test_misshaped_tensor_is_named(copy: Path, name: str) -> None:
    _edit(copy, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(LoadError, match=f"'{name.replace('.', '[.]')}'.*shape"):
        _load(copy)


def test_expert_given_twice_is_refused(copy: Path) -> None:
    gate_up = torch.zeros(6, 64, 64)  # [E, 2I, H] fused copy of experts that are also stored per expert
    _edit(copy, lambda t: t.__setitem__("model.layers.0.mlp.experts.gate_up_proj", gate_up))
    with pytest.raises(LoadError, match="duplicate tensor"):
        _load(copy)


def test_unsupported_architecture(copy: Path) -> None:
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": ["JambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architectures.*Qwen2MoeForCausalLM"):
        _load(copy)


def test_sharded_checkpoint_loads_the_same_weights(qwen2_moe: Path, copy: Path) -> None:
    tensors = load_file(copy / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(copy / shard), metadata={"format": "pt"})
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (copy / "model.safetensors").unlink()
    torch.testing.assert_close(_logits(_load(copy)), _logits(_load(qwen2_moe)), atol=0, rtol=0)


def test_store_holds_every_expert_and_bf16_load_tracks_fp32(qwen2_moe: Path) -> None:
    fp32 = _load(qwen2_moe)
    bf16 = _load(qwen2_moe, torch.bfloat16)
    assert fp32.store.rows.shape == (2, 6, 3 * 64 * 32)  # 2 MoE layers (layer 1 is dense), 6 experts
    assert fp32.store.nbytes == 2 * 6 * 3 * 64 * 32 * 4 and not fp32.store.is_pinned
    assert bf16.store.rows.dtype == bf16.model.dtype == torch.bfloat16
    # bf16 rounding flips the odd routing decision in a random tiny model, so compare in bulk
    similarity = torch.nn.functional.cosine_similarity(_logits(bf16).flatten(), _logits(fp32).flatten(), dim=0)
    assert similarity > 0.99


def test_dense_model_has_no_store_and_needs_no_runner(tmp_path: Path) -> None:
    loaded = load_model(build_tiny_checkpoint("llama", tmp_path / "llama"), progress=False)
    assert loaded.store is None and loaded.config.family == "llama"


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path: Path) -> None:
    path = build_tiny_checkpoint("llama", tmp_path / "llama")  # tie_word_embeddings=True
    before = _logits(load_model(path, progress=False))
    _edit(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    loaded = load_model(path, progress=False)
    assert loaded.model.lm_head.weight is loaded.model.embed.weight
    torch.testing.assert_close(_logits(loaded), before, atol=0, rtol=0)


def test_moe_model_needs_a_runner_factory(qwen2_moe: Path) -> None:
    with pytest.raises(ValueError, match="runner_factory"):
        load_model(qwen2_moe, progress=False)


def test_resolve_dtype() -> None:
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_pins_the_store_and_matches_cpu(qwen2_moe: Path) -> None:
    cpu = _load(qwen2_moe)
    cuda = load_model(qwen2_moe, "cuda", torch.float32, runner_factory=CudaRunner.factory, progress=False)
    assert cuda.store.is_pinned and cuda.model.device.type == "cuda"
    kv = KVCache.for_model(cuda.config, 16, device="cuda", dtype=torch.float32)
    logits = cuda.model(torch.arange(3, 13, device="cuda"), 0, kv).cpu()
    torch.testing.assert_close(logits, _logits(cpu), atol=1e-3, rtol=0)
    bf16 = load_model(qwen2_moe, "cuda", runner_factory=CudaRunner.factory, progress=False)
    assert bf16.model.dtype == torch.bfloat16
    assert bf16.model(torch.arange(3, 13, device="cuda"), 0, KVCache.for_model(
        bf16.config, 16, device="cuda", dtype=torch.bfloat16)).isfinite().all()


class CudaRunner(AllResidentRunner):
    """Copies the routed experts' pinned rows to the GPU on demand (test-only; no cache)."""

    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        out = torch.zeros_like(x)  # [T, H]
        ids = routing.expert_ids.unique().tolist()
        rows = {e: self.store.row(routing.layer, e).to(x.device, non_blocking=True) for e in ids}
        accumulate_experts(out, x, routing.expert_ids, routing.expert_weights, rows, self.store.layouts[routing.layer])
        return out


def test_no_progress_bar_off_a_terminal_only_log_lines(qwen2_moe: Path, capfd: pytest.CaptureFixture,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """stderr captured here is no terminal: the bar's carriage returns must not reach a log file."""
    with caplog.at_level("INFO", logger="moe_serve.engine.loader"):
        load_model(qwen2_moe, runner_factory=AllResidentRunner.factory)
    assert "\r" not in capfd.readouterr().err
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("loading weights: ") and messages[-1].startswith("weights loaded in ")


def test_deepseek_v3_multi_token_prediction_layers_are_skipped_unread(tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers MTP layers numbered after the last
    decoder layer (their own norms and projection beside a whole decoder layer); they load as
    nothing, and a config that does not announce them leaves them unexpected."""
    path = build_tiny_checkpoint("deepseek_v3", tmp_path / "v3")
    config = json.loads((path / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    expected = _logits(_load(path))

    def add_mtp_layer(tensors: Tensors) -> None:
        prefix = f"model.layers.{last}."
        for name in [n for n in tensors if n.startswith(prefix)]:
            tensors[f"model.layers.{mtp}." + name.removeprefix(prefix)] = tensors[name].clone()
        hidden = config["hidden_size"]
        tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
        tensors[f"model.layers.{mtp}.enorm.weight"] = torch.ones(hidden)

    _edit(path, add_mtp_layer)
    torch.testing.assert_close(_logits(_load(path)), expected, rtol=0, atol=0)
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(LoadError, match=f"unexpected tensor 'model[.]layers[.]{mtp}[.]"):
        _load(path)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks",
                                  "model.layers.1.mlp.router.bias"])
def test_gpt_oss_missing_bias_or_sink_is_named(tmp_path: Path, name: str) -> None:
    """gpt-oss's expert biases, attention sinks and router bias are required like any weight."""
    path = _edit(build_tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss"), lambda t: t.pop(name))
    with pytest.raises(LoadError, match=f"missing tensors? .*{name.replace('.', '[.]')}"):
        _load(path)
