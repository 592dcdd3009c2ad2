"""Runs a loaded model: prefill and decode over its KV cache, the captured CUDA graphs of a step,
and the sampler that picks the next token. It owns no HTTP and no model wiring."""
