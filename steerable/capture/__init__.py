"""Activation capture: components, streams, per-request specs, the wire format and consumers.

``steerable.capture`` is both this package and, called, the one-shot helper
``steerable.capture(llm, prompts, ...)`` (see ``api.capture``); the module is made callable so the
public names in the design (``from steerable.capture import ...`` and ``steerable.capture(...)``)
both hold.
"""

import inspect
import sys
import types

from steerable.capture.api import CaptureResult, capture, capture_batches
from steerable.capture.patterns import AttentionPatterns
from steerable.capture.consumers import CaptureConsumer, FilesystemConsumer, LoggingConsumer, read_capture_shard
from steerable.capture.serialization import CaptureMeta, deserialize_captured, match_capture_request_id
from steerable.capture.session import CaptureSession, CaptureSpec
from steerable.capture.store import StreamConfig, StreamStore
from steerable.hook_points import ATTENTION_HEADS, ATTENTION_PATTERNS, HIDDEN_STATES, ROUTER_LOGITS

__all__ = ["HIDDEN_STATES", "ATTENTION_HEADS", "ROUTER_LOGITS", "ATTENTION_PATTERNS", "AttentionPatterns", "CaptureMeta", "CaptureSpec", "CaptureResult",
           "CaptureSession", "StreamConfig", "StreamStore", "CaptureConsumer", "FilesystemConsumer",
           "LoggingConsumer", "read_capture_shard", "deserialize_captured", "match_capture_request_id", "capture",
           "capture_batches"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
# ``inspect.signature``, IDEs and ``help`` show the call's own signature and docstring, not the
# forwarding ``(*args, **kwargs)``.
__signature__ = inspect.signature(capture)
__doc__ = f"{__doc__}\nCalled: ``steerable.capture{__signature__}``\n\n{inspect.getdoc(capture)}\n"
