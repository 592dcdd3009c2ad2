"""What several test modules share, so that no test module imports another (tests/test_layering.py
checks): importing a test module runs all of it, can bring its fixtures into the importer unseen,
and ties an edit of one module's tests to another's. Shared fixtures live in a conftest.py instead.

Split by what each needs installed, so that a machine runs a folder's tests without the packages
other folders need (tests/gpu runs where prometheus_client and openai may be missing): quant (gguf),
engine (torch, a real expertd), expertd (zmq), worker (openai, prometheus_client), bench (nothing)."""
