"""The paged KV cache: block bookkeeping (no torch), the device storage, and attention over it."""
