"""Structured outputs (guided decoding): JSON schema, regex, choice, EBNF grammar, JSON object.

A constraint is described by ``StructuredOutputsParams`` (vLLM's names; it lives beside
``SamplingParams``, as in vLLM); ``backend`` compiles it with xgrammar and keeps each completion's
matcher on the driver; ``bitmask`` applies a step's masks to the logits on the worker.
"""

from steerable.sampling_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
