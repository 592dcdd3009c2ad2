"""The GPU inference worker: trunk in VRAM, a byte-budgeted expert cache fed by expertd, the model
architectures and the OpenAI-compatible API."""
