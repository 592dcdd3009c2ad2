"""Offline planning from a pack and a machine's figures: the expert cache replayed on routing traces
(`expertpack bench cache`) and `expertpack plan`'s sizing and speed prediction. It reads the worker's
cache policy and the daemon's tier sizing; nothing imports it but the commands and benchmarks."""
