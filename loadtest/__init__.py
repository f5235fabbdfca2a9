"""Load, soak and verification runs against a moe-serve server (see loadtest/README.md)."""
