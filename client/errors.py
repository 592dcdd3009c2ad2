"""What ExpertClient raises on purpose: ClientError and its kinds, each saying what happened to the
request and carrying the codes expertd sent (protocol.py). Plain exceptions: nothing here talks to
the daemon."""

from __future__ import annotations

from expertpack.packtools.layout import ExpertKey

from . import protocol as p


class ClientError(Exception):
    """Base of everything ExpertClient raises on purpose."""


class DaemonUnavailable(ClientError):
    """No answer from expertd in time, it said BYE or that it is shutting down, or the connection
    closed under the session."""


class DaemonError(ClientError):
    """expertd answered ERROR: the request was refused and nothing changed."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"expertd refused the request: {code.name}: {message}")
        self.code = code


class FetchFailed(ClientError):
    """expertd could not deliver an expert (FAIL): an I/O error, a corrupt block (code CORRUPT), a
    pack truncated under expertd (code TRUNCATED), a cancel or a shutdown."""

    def __init__(self, key: ExpertKey, code: p.FailCode, message: str) -> None:
        super().__init__(f"expert {tuple(key)}: {code.name}: {message}")
        self.key = key
        self.code = code
        self.message = message


class FingerprintMismatch(ClientError):
    """The daemon serves a different pack than the caller expects."""
