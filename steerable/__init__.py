"""steerable: an LLM inference engine where activation steering and capture are first-class."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("steerable")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

from steerable import capture
from steerable.capture import CaptureSpec, capture_batches
from steerable.entrypoints.async_llm import AsyncLLM, StreamingInput
from steerable.entrypoints.llm import LLM
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec
from steerable.steering.spec import Add, Clamp, SteeringSpec

__all__ = ["LLM", "AsyncLLM", "StreamingInput", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "SelectSpec", "SteeringSpec", "Add", "Clamp", "CaptureSpec", "capture", "capture_batches", "__version__"]
