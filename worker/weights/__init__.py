"""Weights as GGUF stores them: the ggml types' dequantization, quantized tensors and the one place
a matrix meets an activation, an expert block's role layout, and the files a model loads from."""
