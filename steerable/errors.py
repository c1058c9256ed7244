"""Error classes, so a caller (a server above all) can tell its own mistakes from the engine's.

``InvalidRequestError`` is a ``ValueError``: bad input to a request or a control-plane call, the
message naming the field (HTTP 400). Loading errors (a missing model, an unsupported architecture)
stay plain ``ValueError``; ``EngineError`` is a failure inside the engine (HTTP 500), and
``EngineDeadError`` says the engine refuses further work until it is rebuilt.
"""

from __future__ import annotations


class SteerableError(Exception):
    """Base of the errors steerable raises on purpose."""


class InvalidRequestError(SteerableError, ValueError):
    """Bad input from the caller; nothing was admitted or changed."""


class EngineError(SteerableError, RuntimeError):
    """A step failed inside the engine; the affected requests finished with ``finish_reason='error'``."""


class EngineDeadError(EngineError):
    """The engine can no longer run steps (shut down, or a worker died)."""
