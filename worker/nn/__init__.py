"""The building blocks the architectures in `models/` wire together: norms, rotary embeddings,
attention variants, routing functions, the one MoE entry point, and the placement of layers over
several devices. Pure torch on whatever device the inputs live on; kernels behind the seams."""
