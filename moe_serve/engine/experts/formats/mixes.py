"""llama.cpp's K-quant mixes as --expert-quant values: a format per layer and matrix, not one format.

A Q4_K_M or Q5_K_M file is not all Q4_K / Q5_K: llama.cpp's quantizer gives the down projection
Q6_K in the layers it counts as sensitive (the first and last eighth of the layers, and every third
one between) and the mix's base type everywhere else; gate and up always take the base type.
`--expert-quant q4_k_m` quantizes the routed experts of a float checkpoint the same way, so the
rows, bytes and quality are those of the file llama.cpp would write for them (with this engine's
round-to-nearest encoders, not llama.cpp's scale search). Only the routed experts: the other
weights keep --dtype. Names only, no torch (the CLI lists them).
"""
from __future__ import annotations

# mix -> (base format of gate/up and of the other layers' down, the sensitive layers' down format)
MIXES = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose down projection gets the larger type: the first and
    last eighth (integer division, as there) and every third layer from the first eighth on."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def mix_formats(mix: str, layer: int, num_layers: int) -> tuple[str, str]:
    """(gate/up's, down's) format names of decoder layer `layer` of `num_layers` under `mix`.
    llama.cpp counts the model's ffn_down tensors; one per layer, as here, where every layer has
    one (a shared expert's adds another there)."""
    base, more = MIXES[mix]
    return base, more if more_bits(layer, num_layers) else base
