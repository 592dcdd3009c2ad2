"""Offline tools around the expert pack: build a pack from a GGUF (one file or a split set), verify
it, inspect it, and synthesize GGUFs of real architectures. Never imports torch: these commands start
in milliseconds."""
