"""Triton kernels of the GPU fast path: GGUF bytes decoded in registers, fused into the matrix
products of the trunk and of all the experts a layer selected. They run on CUDA, and on the CPU
under Triton's interpreter (TRITON_INTERPRET=1), which is how CI checks their logic; nothing here is
imported on the plain CPU path."""
