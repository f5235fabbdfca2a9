"""Model families over shared blocks. `FAMILIES` maps HF `architectures` names to a Family."""
from engine.models.blocks import CausalLM
from engine.models.config import ModelConfig
from engine.models.family import Family
from engine.models.registry import FAMILIES, family_for

__all__ = ["FAMILIES", "CausalLM", "Family", "ModelConfig", "family_for"]
