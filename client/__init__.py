"""The expertd wire protocol, the Python client library and the `expertctl` ops CLI. Imports
neither the daemon nor the worker."""
