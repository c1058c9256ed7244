"""Cumulative ``RequestOutput``s across a process boundary, as increments of plain tuples.

The engine process reports every streamed request every step, each output holding everything the
request has produced so far. For 256 requests at 550 tokens, pickling such a step took 3.5-4.3 ms
and unpickling it 9-10 ms on a 2-core CPU (``benchmarks/output_codec.py``), about what an H200
decode step of that batch takes. So ``OutputEncoder`` (engine side) keeps what it has sent per
completion and sends only the rest, as tuples of built-in types, which pickle at C speed (1.2-1.4
ms per step there), and ``OutputDecoder`` (server side) keeps the other half and rebuilds each
output as a fresh cumulative snapshot, equal to the engine's (3.2 ms).

Tokens and logprobs only grow; text may shrink, when a stop string is cut off its end. An
increment therefore says where its part starts: ``(tokens_at, text_at, logprobs_at)``. Outputs of
streaming-input requests go whole (``whole=True``): each chunk restarts their completion, which an
increment could not tell from growth.

Two increments of a request in a row fold into one (``merge_increments``): an engine whose reader
fell behind sends each request once for all the steps it waited, so the reader catches up.
"""

from __future__ import annotations

from typing import Any

from steerable.outputs import CompletionOutput, RequestOutput

_Sent = tuple[int, str, int]  # tokens, text, logprobs the other side holds


class OutputEncoder:
    """Engine side: ``encode`` a step's outputs; ``forget`` a request that will send no more."""

    def __init__(self) -> None:
        self._prompt_lens: dict[str, int] = {}
        self._sent: dict[tuple[str, int], _Sent] = {}

    def encode(self, out: RequestOutput, whole: bool = False) -> tuple:
        rid = out.request_id
        prompt_ids = out.prompt_token_ids
        if self._prompt_lens.get(rid) == len(prompt_ids):  # a prompt only grows: same length, same prompt
            prompt = None
        else:
            self._prompt_lens[rid] = len(prompt_ids)
            prompt = (out.prompt, prompt_ids)
        completions = tuple(self._completion(rid, c, whole) for c in out.outputs)
        if out.finished:
            self.forget(rid, [c.index for c in out.outputs])
        return rid, out.finished, prompt, completions, out.captures or None, out.capture_meta or None

    def forget(self, rid: str, indices: list[int]) -> None:
        self._prompt_lens.pop(rid, None)
        for index in indices:
            self._sent.pop((rid, index), None)

    def _completion(self, rid: str, c: CompletionOutput, whole: bool) -> tuple:
        tokens, text, logprobs = c.token_ids, c.text, c.logprobs
        tokens_at, sent_text, logprobs_at = (0, "", 0) if whole else self._sent.get((rid, c.index), (0, "", 0))
        text_at = len(sent_text) if text.startswith(sent_text) else 0
        num_logprobs = len(logprobs) if logprobs is not None else 0
        self._sent[(rid, c.index)] = (len(tokens), text, num_logprobs)
        return (c.index, tokens_at, tokens[tokens_at:], text_at, text[text_at:], logprobs_at,
                None if logprobs is None else logprobs[logprobs_at:], c.finish_reason,
                c.stop_reason, c.cumulative_logprob, c.captures or None, c.capture_meta or None)


class OutputDecoder:
    """Server side: ``decode`` an encoded output into a cumulative ``RequestOutput``."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[Any, list[int]]] = {}
        self._held: dict[tuple[str, int], tuple[list[int], str, list | None]] = {}

    def decode(self, encoded: tuple) -> RequestOutput:
        rid, finished, prompt, completions, captures, capture_meta = encoded
        if prompt is None:
            prompt = self._prompts[rid]
        else:
            self._prompts[rid] = prompt
        outputs = [self._completion(rid, c) for c in completions]
        if finished:
            self._prompts.pop(rid, None)
            for c in outputs:
                self._held.pop((rid, c.index), None)
        return RequestOutput(rid, prompt[0], prompt[1], outputs, finished, captures or {}, capture_meta or {})

    def _completion(self, rid: str, encoded: tuple) -> CompletionOutput:
        (index, tokens_at, tokens, text_at, text, logprobs_at, logprobs, finish_reason, stop_reason, cumulative,
         captures, capture_meta) = encoded
        held_tokens, held_text, held_logprobs = self._held.get((rid, index), ([], "", None))
        tokens = _joined(held_tokens, tokens_at, tokens)
        text = held_text + text if text_at == len(held_text) else held_text[:text_at] + text
        if logprobs is not None:
            logprobs = _joined(held_logprobs or [], logprobs_at, logprobs)
        self._held[(rid, index)] = (tokens, text, logprobs)
        return CompletionOutput(index, text, tokens, finish_reason, logprobs, stop_reason, cumulative,
                                captures or {}, capture_meta or {})


def _joined(held: list, at: int, new: list) -> list:
    """``held[:at] + new`` as a new list, copying ``held`` once in the usual case (``at`` at its end)."""
    return held + new if at == len(held) else held[:at] + new


def merge_increments(first: tuple, then: tuple) -> tuple:
    """One increment of a request that leaves the decoder where ``first`` then ``then`` would."""
    rid, _, prompt, completions, captures, capture_meta = first
    _, finished, then_prompt, then_completions, then_captures, then_meta = then
    merged = {c[0]: c for c in completions}
    for c in then_completions:
        merged[c[0]] = _merge_completion(merged[c[0]], c) if c[0] in merged else c
    return (rid, finished, then_prompt if then_prompt is not None else prompt, tuple(merged.values()),
            then_captures or captures, then_meta or capture_meta)


def _merge_completion(first: tuple, then: tuple) -> tuple:
    index, tokens_at, tokens, text_at, text, logprobs_at, logprobs = first[:7]
    _, then_tokens_at, then_tokens, then_text_at, then_text, then_logprobs_at, then_logprobs = then[:7]
    tokens_at, tokens = _spliced(tokens_at, tokens, then_tokens_at, then_tokens)
    text_at, text = _spliced(text_at, text, then_text_at, then_text)
    if logprobs is None or then_logprobs is None:
        logprobs_at, logprobs = then_logprobs_at, then_logprobs
    else:
        logprobs_at, logprobs = _spliced(logprobs_at, logprobs, then_logprobs_at, then_logprobs)
    finish_reason, stop_reason, cumulative, captures, capture_meta = then[7:]
    return (index, tokens_at, tokens, text_at, text, logprobs_at, logprobs, finish_reason, stop_reason, cumulative,
            captures or first[10], capture_meta or first[11])


def _spliced(at: int, part: Any, then_at: int, then_part: Any) -> tuple[int, Any]:
    """``part`` written from ``at``, then ``then_part`` from ``then_at``, as one write (the decoder
    keeps what precedes a write and drops what follows it)."""
    if then_at < at:
        return then_at, then_part
    return at, part[:then_at - at] + then_part
