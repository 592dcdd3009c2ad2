"""The expertd wire protocol, the Python client library and the `expertctl` ops CLI. Imports
neither the daemon nor the worker."""

from .client import DEFAULT_ENDPOINT, Expert, ExpertClient, Pending, release_all  # the public API, re-exported
from .errors import ClientError, DaemonError, DaemonUnavailable, FetchFailed, FingerprintMismatch
from .protocol import Priority

__all__ = ["DEFAULT_ENDPOINT", "ClientError", "DaemonError", "DaemonUnavailable", "Expert", "ExpertClient",
           "FetchFailed", "FingerprintMismatch", "Pending", "Priority", "release_all"]
