"""Model families over shared blocks. `FAMILIES` maps HF `architectures` names to a Family."""
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.models.family import Family
from moe_serve.engine.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "CausalLM", "Family", "ModelConfig", "family_for"]
