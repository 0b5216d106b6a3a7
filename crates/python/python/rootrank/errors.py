"""rootrank's exceptions. Each also derives from the builtin it is a case of, so code that
catches ``ValueError`` or ``ConnectionError`` keeps working."""

from __future__ import annotations


class RootrankError(Exception):
    """Base class of every error rootrank raises."""


class InvalidInput(RootrankError, ValueError):
    """A bad group, rank, room, reason, peer or setting. Nothing was enqueued or written."""


class AgentStopped(RootrankError, RuntimeError):
    """The agent was shut down; create a new one to publish again."""


class CoordinatorError(RootrankError):
    """The coordinator answered with an error (``code`` and ``message`` from its JSON)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.url = url


class CoordinatorUnavailable(CoordinatorError, ConnectionError):
    """No replica could be reached (or every one answered 503 not ready / behind)."""


class NotFound(CoordinatorError, LookupError):
    """The coordinator does not know that group."""
