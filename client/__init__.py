"""The expertd wire protocol, the Python client library and the `expertctl` ops CLI. Imports
neither the daemon nor the worker."""

from .client import (  # noqa: E402  (the public API, re-exported)
    DEFAULT_ENDPOINT, ClientError, DaemonError, DaemonUnavailable, Expert, ExpertClient, FetchFailed,
    FingerprintMismatch, Pending, release_all,
)
from .protocol import Priority  # noqa: E402

__all__ = ["DEFAULT_ENDPOINT", "ClientError", "DaemonError", "DaemonUnavailable", "Expert", "ExpertClient",
           "FetchFailed", "FingerprintMismatch", "Pending", "Priority", "release_all"]
