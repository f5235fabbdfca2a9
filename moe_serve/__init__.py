"""moe-serve: an OpenAI-compatible server for MoE models on one GPU.

server/ (HTTP, OpenAI surface) -> engine/ (scheduler, model runner, speculative decoding,
expert cache, pinned store, PCIe copies); models/ holds the default model, configs/ the presets.
"""
