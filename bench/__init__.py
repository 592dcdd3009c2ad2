"""Benchmarks, one home: the shipped `expertpack bench io|serve|cache` (bench_io.py, bench_serve.py,
bench_cache.py) and the scripts run as `python bench/NAME.py` on a dev or GPU machine (with their
`*.sh` wrappers). Each prints a table and, last, one JSON line; results are in BENCHMARKS.md. Above
every other package: it may drive the daemon, the client and the worker; nothing imports it but
the `expertpack` command. Importing the package imports nothing."""
