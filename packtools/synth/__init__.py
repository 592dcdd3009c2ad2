"""`expertpack synth`: synthetic GGUFs of real MoE architectures for benchmarks, tests and the demo."""
