"""Structured outputs (guided decoding): JSON schema, regex, choice, EBNF grammar, JSON object.

``params`` describes a constraint (vLLM's names); ``backend`` compiles it with xgrammar and keeps
each completion's matcher on the driver; ``bitmask`` applies a step's masks to the logits on the
worker.
"""

from steerable.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
