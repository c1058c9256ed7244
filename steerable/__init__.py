"""steerable: an LLM inference engine where activation steering and capture are first-class."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("steerable")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

# The public names load on first use (PEP 562), so ``steerable --help`` answers before torch is imported.
_EXPORTS = {
    "capture": "steerable.capture", "CaptureSpec": "steerable.capture", "capture_batches": "steerable.capture",
    "capture_corpus": "steerable.capture.corpus",
    "AsyncLLM": "steerable.entrypoints.async_llm", "StreamingInput": "steerable.entrypoints.async_llm",
    "LLM": "steerable.entrypoints.llm", "CompletionOutput": "steerable.outputs", "Logprob": "steerable.outputs",
    "RequestOutput": "steerable.outputs", "SamplingParams": "steerable.sampling_params",
    "SelectSpec": "steerable.selection", "Add": "steerable.steering.spec", "Clamp": "steerable.steering.spec",
    "SteeringSpec": "steerable.steering.spec", "LowRank": "steerable.steering.items",
    "Affine": "steerable.steering.items", "When": "steerable.steering.items", "RouterBias": "steerable.steering.items",
    "SAE": "steerable.sae", "Transcoder": "steerable.sae", "Feature": "steerable.sae",
    "FeatureClamp": "steerable.sae", "StructuredOutputsParams": "steerable.structured",
    "GuidedDecodingParams": "steerable.structured", "TextPrompt": "steerable.inputs",
    "TokensPrompt": "steerable.inputs", "ActivationStream": "steerable.entrypoints.activation_stream",
    "feature_dashboards": "steerable.sae.dashboards",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'steerable' has no attribute {name!r}")
    import importlib

    loaded = importlib.import_module(module)
    value = loaded if name == "capture" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names too, loaded or not, so ``help(steerable)`` and completion list them."""
    return sorted({*globals(), *_EXPORTS})


__all__ = ["LLM", "AsyncLLM", "StreamingInput", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "SelectSpec", "SteeringSpec", "Add", "Clamp", "LowRank", "Affine", "When", "RouterBias", "SAE", "Transcoder",
           "Feature", "FeatureClamp", "CaptureSpec", "capture", "capture_batches", "capture_corpus",
           "StructuredOutputsParams", "GuidedDecodingParams", "TextPrompt", "TokensPrompt", "ActivationStream",
           "feature_dashboards",
           "__version__"]
