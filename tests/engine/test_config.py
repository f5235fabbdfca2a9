"""--max-model-len against the model: its own length by default, RoPE scaling stretching it, longer an error."""
from __future__ import annotations

import pytest

from moe_serve.engine.config import ConfigError, model_context_length, resolve_max_model_len
from moe_serve.engine.models.config import ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 4096}


def model(rope: dict | None = None) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "rope_scaling": rope} if rope else BASE)


@pytest.mark.parametrize(("rope", "length"), [
    (None, 4096),
    ({"rope_type": "linear", "factor": 4.0}, 16384),
    ({"rope_type": "dynamic", "factor": 2.0}, 8192),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),
])
def test_context_length_follows_rope_scaling(rope: dict | None, length: int) -> None:
    assert model_context_length(model(rope)) == length


def test_default_is_the_models_own_length_and_longer_is_an_error() -> None:
    assert resolve_max_model_len(None, model()) == 4096
    assert resolve_max_model_len(1000, model()) == 1000
    with pytest.raises(ConfigError, match="8192 is longer than this model's context length 4096"):
        resolve_max_model_len(8192, model())
