"""The tiny checkpoint + tokenizer the server tests use, for the lowest-versions smoke test."""
from tests.server.conftest import tiny_model  # noqa: F401  (a fixture, re-exported)
