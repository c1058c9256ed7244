"""steerable: an LLM inference engine where activation steering and capture are first-class."""

from steerable.entrypoints.llm import LLM
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
