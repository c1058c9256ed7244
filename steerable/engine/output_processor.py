"""From sampled tokens to what the caller sees: incremental text, stop checks, logprobs, and one
``RequestOutput`` per client request (``n`` completions, captures once all have finished), or, for
requests streamed across a process boundary, one increment of it (``OutputProcessor.increment``)."""

from __future__ import annotations

from typing import Any

import torch

from steerable.capture.patterns import concat_captured
from steerable.capture.serialization import CaptureMeta
from steerable.engine.tokenizer import Tokenizer
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.request import Request


class RequestGroup:
    """What a caller submitted under one client id: ``n`` sibling requests sharing the prompt,
    reported together as one ``RequestOutput`` with ``n`` completions."""

    def __init__(self, client_id: str, children: list[Request], stream: bool, increments: bool = False):
        self.client_id = client_id
        self.children = children
        self.stream = stream
        self.increments = increments  # report increments (``OutputProcessor.increment``), not RequestOutputs

    @property
    def request_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    @property
    def finished(self) -> bool:
        if len(self.children) == 1:  # asked for every output of every step: keep it cheap
            return self.children[0].finished
        return all(child.finished for child in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def accept_token(self, request: Request, token: int, token_logprobs: dict | None) -> None:
        """Record a sampled token; sets ``finish_reason`` when it ends the request."""
        piece = request.detokenizer.step(token)
        request.output_text += piece
        if token_logprobs is not None:
            request.logprobs.append({t: Logprob(lp, rank, self.tokenizer.token_text(t))
                                     for t, (lp, rank) in token_logprobs.items()})
            request.cumulative_logprob += token_logprobs[token][0]
        params = request.params
        if token in request.stop_token_ids:  # the sampler masks them until min_tokens
            request.finish_reason = "stop"
            request.stop_reason = None if token in request.eos_token_ids else token
            return
        if params.stop_strings and piece and self._check_stop_strings(request, len(piece)):
            return
        known = request.num_tokens - request.num_pending
        if known - request.num_prompt_tokens >= params.max_tokens or known >= self.max_model_len:
            request.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(request: Request, new_chars: int) -> bool:
        text = request.output_text
        for stop in request.params.stop_strings:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1:
                request.output_text = text[:index + len(stop)] if request.params.include_stop_str_in_output \
                    else text[:index]
                request.finish_reason = "stop"
                request.stop_reason = stop
                return True
        return False

    def report(self, group: RequestGroup) -> RequestOutput | tuple:
        """What the group's caller gets now: its increment or its cumulative output."""
        return self.increment(group) if group.increments else self.output(group)

    @staticmethod
    def output(group: RequestGroup) -> RequestOutput:
        """The group's cumulative state, a snapshot that later steps leave alone (its lists are
        copies); captures (of every completion, by index) once all finished."""
        completions = [CompletionOutput(r.index, r.output_text, r.output_token_ids, r.finish_reason,
                                        None if r.logprobs is None else list(r.logprobs), r.stop_reason,
                                        r.cumulative_logprob if r.logprobs is not None else None,
                                        r.captures, r.capture_meta)
                       for r in group.children]
        first = group.children[0]
        finished = group.finished
        captures, capture_meta = _merge_captures(group.children) if finished else ({}, {})
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(group.client_id, first.prompt, first.prompt_token_ids, completions, finished, captures,
                             capture_meta, prompt_logprobs)

    @staticmethod
    def increment(group: RequestGroup) -> tuple:
        """What ``output(group)`` gained since the group's last increment, as plain tuples (the
        format ``steerable.entrypoints.output_codec`` decodes and folds). ``output`` copies every
        token and character so far, O(length) per request per step; this costs O(new) and pickles
        at C speed.

        ``(client_id, finished, prompt, completions, captures, capture_meta)``: ``prompt`` is
        ``(text, token_ids, prompt_logprobs)`` in a completion's first increment (its prefill is
        done by then; after a streaming-input chunk restarted it, too), else None; each completion is ``(index, tokens_at, tokens, text_at,
        text, logprobs_at, logprobs, finish_reason, stop_reason, cumulative_logprob, captures,
        capture_meta)``, each part written from its ``*_at`` on. Tokens and logprobs only grow, text
        too except where a stop string cuts it back, hence the positions.
        """
        children = group.children
        first = children[0]
        prompt = (first.prompt, first.prompt_token_ids, first.prompt_logprobs) if first.reported is None else None
        completions = tuple(_completion_increment(r) for r in children)
        finished = group.finished
        captures, capture_meta = _merge_captures(children) if finished else ({}, {})
        return group.client_id, finished, prompt, completions, captures or None, capture_meta or None


def _completion_increment(r: Request) -> tuple:
    tokens_at, text_at, logprobs_at = r.reported or (0, 0, 0)
    start = len(r.prompt_token_ids)
    known = len(r.all_token_ids) - r.num_pending
    text = r.output_text
    text_at = min(text_at, len(text))  # a stop string cut the text back to here
    logprobs = r.logprobs
    r.reported = (known - start, len(text), 0 if logprobs is None else len(logprobs))
    return (r.index, tokens_at, r.all_token_ids[start + tokens_at:known], text_at, text[text_at:], logprobs_at,
            None if logprobs is None else logprobs[logprobs_at:], r.finish_reason, r.stop_reason,
            None if logprobs is None else r.cumulative_logprob, r.captures or None, r.capture_meta or None)


def _merge_captures(children: list[Request]) -> tuple[dict, dict]:
    """One request's captures as they are; several completions' rows concatenated by index, each
    row still labelled with its own engine request id."""
    if len(children) == 1:
        return children[0].captures, children[0].capture_meta
    tensors: dict[str, dict[int, Any]] = {}
    metas: dict[str, dict[int, Any]] = {}
    for stream in children[0].captures:
        tensors[stream], metas[stream] = {}, {}
        for layer in children[0].captures[stream]:
            tensors[stream][layer] = concat_captured([c.captures[stream][layer] for c in children])
            metas[stream][layer] = CaptureMeta.concat([c.capture_meta[stream][layer] for c in children])
    return tensors, metas
