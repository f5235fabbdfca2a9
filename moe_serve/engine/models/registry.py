"""HF `architectures` -> model family."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from moe_serve.engine.models.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from moe_serve.engine.models.dots1 import DOTS1
from moe_serve.engine.models.ernie4_5_moe import ERNIE4_5_MOE
from moe_serve.engine.models.family import Family
from moe_serve.engine.models.glm4_moe import GLM4_MOE
from moe_serve.engine.models.gpt_oss import GPT_OSS
from moe_serve.engine.models.llama import LLAMA, MISTRAL
from moe_serve.engine.models.minimax_m2 import MINIMAX_M2
from moe_serve.engine.models.mixtral import MIXTRAL
from moe_serve.engine.models.olmoe import OLMOE
from moe_serve.engine.models.qwen2 import QWEN2
from moe_serve.engine.models.qwen2_moe import QWEN2_MOE
from moe_serve.engine.models.qwen3 import QWEN3
from moe_serve.engine.models.qwen3_moe import QWEN3_MOE

FAMILIES: MappingProxyType[str, Family] = MappingProxyType(
    {arch: family
     for family in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V2, DEEPSEEK_V3,
                    GLM4_MOE, MINIMAX_M2, ERNIE4_5_MOE, DOTS1, GPT_OSS)
     for arch in family.architectures}
)


def family_for(hf: dict[str, Any]) -> Family:
    """The family of a config.json dict, from its `architectures` list."""
    for arch in hf.get("architectures") or ():
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ValueError(
        f"unsupported architectures {hf.get('architectures')!r}; supported: {', '.join(sorted(FAMILIES))}"
    )
