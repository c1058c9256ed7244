"""Cumulative ``RequestOutput``s rebuilt from the engine's increments, across a process boundary.

The engine process reports every streamed request every step. Each output holding everything the
request has produced so far, pickling a step of 256 requests at 550 tokens took 3.5-4.3 ms and
unpickling it 9-10 ms on a 2-core CPU (``benchmarks/output_codec.py``), about what an H200 decode
step of that batch takes; building those outputs took the engine a fifth of its host time on the
H200. So the engine reports such requests as increments (``OutputProcessor.increment``: what is
new, as tuples of built-in types, which pickle at C speed), and ``OutputDecoder`` (server side)
keeps what came before and rebuilds each output as a fresh cumulative snapshot, equal to the
engine's own ``RequestOutput``.

Two increments of a request in a row fold into one (``merge_increments``): an engine whose reader
fell behind sends each request once for all the steps it waited, so the reader catches up.
"""

from __future__ import annotations

from typing import Any

from steerable.outputs import CompletionOutput, RequestOutput


class OutputDecoder:
    """Server side: ``decode`` an increment into a cumulative ``RequestOutput``. An increment
    carries only the completions that changed; the others are those decoded before (unchanged
    ``CompletionOutput`` objects are shared between snapshots, so a request of many completions
    costs per increment what changed, plus one list of references)."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[Any, list[int]]] = {}
        self._held: dict[tuple[str, int], tuple[list[int], str, list | None]] = {}
        self._outputs: dict[str, list[CompletionOutput | None]] = {}  # by completion index

    def decode(self, increment: tuple) -> RequestOutput:
        rid, finished, prompt, completions, captures, capture_meta = increment
        if prompt is None:
            prompt = self._prompts[rid]
        else:
            self._prompts[rid] = prompt
        held = self._outputs.setdefault(rid, [])
        for c in completions:
            out = self._completion(rid, c)
            if out.index >= len(held):
                held.extend([None] * (out.index + 1 - len(held)))
            held[out.index] = out
        outputs = [c for c in held if c is not None]
        if finished:
            self._prompts.pop(rid, None)
            del self._outputs[rid]
            for c in outputs:
                self._held.pop((rid, c.index), None)
        return RequestOutput(rid, prompt[0], prompt[1], outputs, finished, captures or {}, capture_meta or {},
                             prompt[2], prompt[3])

    def _completion(self, rid: str, increment: tuple) -> CompletionOutput:
        (index, tokens_at, tokens, text_at, text, logprobs_at, logprobs, finish_reason, stop_reason, cumulative,
         captures, capture_meta) = increment
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
