"""The `expertpack` command: one entry point above packtools, the worker and the benchmarks, which
dispatches each verb to the package that owns it. Nothing imports this package."""
