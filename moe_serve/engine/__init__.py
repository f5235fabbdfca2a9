"""Single-GPU MoE inference engine: models, expert store/cache/prefetch, speculative decoding."""
