"""The grammar library (xgrammar) behind structured outputs: compile a request's constraint once,
give each completion its own matcher, and fill the token bitmasks of a step's constrained rows.

All of it runs on the driver (host): the worker only receives the packed bitmask, a plain array
(``SamplingInput.grammar_bitmask``), and applies it to the logits (``steerable.structured.bitmask``).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np

from steerable.errors import InvalidRequestError
from steerable.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'steerable[structured]' (the xgrammar package)"
# xgrammar's C++ errors start with a timestamp and a source location: not the caller's business.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK = re.compile(r"Check failed: \([^)]*\) is false:\s*")


class GrammarBackend:
    """One per engine, built on the first constrained request (xgrammar's tokenizer tables take
    a fraction of a second). Compiled grammars are cached by the compiler, so the ``n`` siblings
    of a request and repeated schemas compile once."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask

    @classmethod
    def create(cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], field: str) -> GrammarBackend:
        """``InvalidRequestError`` naming ``field`` when the library or a tokenizer is missing."""
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            raise InvalidRequestError(f"{field}: structured outputs need the xgrammar package, which is not "
                                      f"installed: {INSTALL_HINT}") from None
        if hf_tokenizer is None:
            raise InvalidRequestError(f"{field}: this model has no tokenizer, which structured outputs need")
        return cls(hf_tokenizer, vocab_size, stop_token_ids)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; a bad schema, regex or grammar is refused naming its field."""
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as err:
            raise InvalidRequestError(f"{params.field_name}: {_clean(err)}") from None

    def matcher(self, compiled: Any) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def bitmask(self, states: list[GrammarState]) -> np.ndarray:
        """int32 [len(states), words]: bit ``t % 32`` of word ``t // 32`` set where token t is allowed."""
        import torch

        mask = torch.empty((len(states), self.words), dtype=torch.int32)
        for i, state in enumerate(states):
            state.matcher.fill_next_token_bitmask(mask, i)
        return mask.numpy()


class GrammarState:
    """One completion's position in its grammar; advanced once per token the request accepts."""

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.num_accepted = 0  # output tokens fed so far

    def accept(self, token: int) -> bool:
        """Feed one sampled token; False when the grammar does not allow it (the matcher is unchanged)."""
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (as vLLM builds it)."""
    quoted = (json.dumps(c, ensure_ascii=False) for c in choices)
    return "root ::= " + " | ".join(quoted)


def _clean(err: Exception) -> str:
    text = _CHECK.sub("", _LOCATION.sub("", str(err).strip()))
    return text.splitlines()[0] if text else type(err).__name__
