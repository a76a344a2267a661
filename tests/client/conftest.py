"""The client tests talk to the servers of the server tests."""

from tests.server.conftest import byte_tokenizer, tiny_llama_dir, toy_server

__all__ = ["byte_tokenizer", "tiny_llama_dir", "toy_server"]
