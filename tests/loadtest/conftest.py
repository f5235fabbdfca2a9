"""The tiny checkpoint + tokenizer the server tests use, for the load-test tests."""
from tests.server.conftest import tiny_model  # noqa: F401  (a fixture, re-exported)
