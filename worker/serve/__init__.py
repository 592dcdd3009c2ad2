"""What a user talks to: the `expert-worker` process, its OpenAI-compatible HTTP API, one request's
generation loop, the GGUF's tokenizer and chat template, and /metrics. It drives the engine and
never touches kernels, weights or the daemon link directly."""
