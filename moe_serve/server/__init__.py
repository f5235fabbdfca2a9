"""moe-serve: the OpenAI-compatible HTTP front end; the engine runs in its own process."""
