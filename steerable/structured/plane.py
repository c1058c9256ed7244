"""The engine's side of structured outputs: admit a constrained completion (compile, give it a
matcher), fill the step's masks from the matchers, and advance a matcher by each token its
request accepts.

A matcher moves only when the engine accepts a sampled token (``accept``), never when a step is
built, so a recompute after preemption, which prefills tokens already accepted, cannot move it
twice; each of ``n`` siblings owns its own. A mask for step k+1 needs step k's token, so the
engine does not build a step ahead of the device while a constrained request runs
(``must_sync``); batches without one keep the overlap.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from steerable.errors import InvalidRequestError
from steerable.request import Request
from steerable.sampling_params import SamplingParams
from steerable.step import SamplingInput
from steerable.structured.backend import GrammarBackend

logger = logging.getLogger(__name__)


class StructuredPlane:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self.live = 0  # admitted completions holding a matcher

    def _get_backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend.create(self._tokenizer, self._vocab_size, self._stop_token_ids,
                                                  "structured_outputs")
        return self._backend

    def check(self, params: SamplingParams) -> None:
        """Compile the request's constraint now, so a bad one is refused before anything is held."""
        if params.structured_outputs is not None:
            self._get_backend().compile(params.structured_outputs)

    def admit(self, request: Request) -> None:
        """Give a completion its own matcher (the compiled grammar is shared through the cache)."""
        spec = request.params.structured_outputs
        if spec is None:
            return
        backend = self._get_backend()
        request.grammar = backend.matcher(backend.compile(spec))
        self.live += 1

    def release(self, request: Request) -> None:
        if request.grammar is not None:
            request.grammar = None
            self.live -= 1

    def must_sync(self, running: list[Request]) -> bool:
        """A running constrained request needs its last token on the host before the next plan."""
        return self.live > 0 and any(r.grammar is not None for r in running)

    def plan(self, sampling: SamplingInput, requests: list[Request]) -> None:
        """Fill the masks of the step's constrained rows (``requests``: one per sampled row)."""
        if not self.live:
            return
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return
        for i in rows:
            request = requests[i]
            if request.grammar.num_accepted != request.num_output_tokens or request.num_pending:
                raise RuntimeError(f"structured outputs: request {request.request_id} was planned before its last "
                                   "token was accepted")
        sampling.grammar_rows = np.array(rows, dtype=np.int64)
        sampling.grammar_bitmask = self._get_backend().bitmask([requests[i].grammar for i in rows])

    @staticmethod
    def accept(request: Request, token: int) -> None:
        """Advance the request's matcher by a token it accepted (its stop checks already ran): the
        grammar's end finishes the request ("stop"); a token the grammar refuses (reachable only
        when other constraints, e.g. ``allowed_token_ids``, left the row no allowed token) ends
        it as "abort"."""
        state = request.grammar
        if state is None or request.finish_reason is not None:
            return
        if not state.accept(token):
            logger.warning("structured outputs: request %s sampled token %d, which its grammar does not allow "
                           "(other constraints masked every allowed token); aborting it", request.request_id, token)
            request.finish_reason = "abort"
        elif state.terminated:
            request.finish_reason = "stop"


def refuse_streaming_input(params: SamplingParams) -> None:
    """Streaming input restarts generation per chunk; a grammar spanning chunks is not supported."""
    if params.structured_outputs is not None:
        raise InvalidRequestError("structured_outputs: not supported with streaming input")
