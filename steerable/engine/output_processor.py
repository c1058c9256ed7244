"""From sampled tokens to what the caller sees: incremental text, stop checks, logprobs, and one
``RequestOutput`` per client request (``n`` completions, captures once all have finished), or, for
requests streamed across a process boundary, one increment of it (``OutputProcessor.increment``)."""

from __future__ import annotations

from typing import Any


from steerable.capture.patterns import concat_captured
from steerable.capture.serialization import CaptureMeta
from steerable.engine.tokenizer import Tokenizer
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.request import Request


class RequestGroup:
    """What a caller submitted under one client id: ``n`` sibling requests sharing the prompt,
    reported together as one ``RequestOutput`` with ``n`` completions.

    Siblings are created as the scheduler has room (``LLMEngine._fan_out``), so an ``n`` of
    thousands costs nothing before its first step: ``children`` holds those created so far, by
    index. Every cost per step or per finish is in the children created and changed, never ``n``:
    a count of unfinished children answers ``finished``, and increments carry only the children
    that changed since the last one (``changed``)."""

    def __init__(self, client_id: str, children: list[Request], stream: bool, increments: bool = False,
                 n: int | None = None):
        self.client_id = client_id
        self.children = children
        self.n = n if n is not None else len(children)
        self.stream = stream
        self.increments = increments  # report increments (``OutputProcessor.increment``), not RequestOutputs
        self.num_unfinished = self.n
        self.template: Request | None = None  # siblings are made from it while some are not yet created
        self.shared_blocks = 0  # prompt blocks siblings wait to find in the prefix cache
        self.cancelled: str | None = None  # finish reason of the siblings never created (abort, error)
        self.changed: dict[int, Request] = {child.index: child for child in children}

    @property
    def request_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    @property
    def num_uncreated(self) -> int:
        return 0 if self.cancelled is not None else self.n - len(self.children)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def child_finished(self, child: Request) -> None:
        self.num_unfinished -= 1
        self.changed[child.index] = child

    def cancel_uncreated(self, reason: str) -> None:
        """The siblings not yet created finish as ``reason`` without running."""
        if self.num_uncreated:
            self.num_unfinished -= self.num_uncreated
            self.cancelled = reason


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
        copies): a completion per child created so far (all ``n`` once finished); captures (of
        every completion, by index) once all finished."""
        completions = [CompletionOutput(r.index, r.output_text, r.output_token_ids, r.finish_reason,
                                        None if r.logprobs is None else list(r.logprobs), r.stop_reason,
                                        r.cumulative_logprob if r.logprobs is not None else None,
                                        r.captures, r.capture_meta)
                       for r in group.children]
        if group.cancelled is not None:
            completions += [CompletionOutput(i, "", [], group.cancelled) for i in range(len(group.children), group.n)]
        first = group.children[0]
        finished = group.finished
        captures, capture_meta = _merge_captures(group.children) if finished and group.cancelled is None else ({}, {})
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(group.client_id, first.prompt, first.prompt_token_ids, completions, finished, captures,
                             capture_meta, prompt_logprobs, first.num_cached_tokens)

    @staticmethod
    def increment(group: RequestGroup) -> tuple:
        """What ``output(group)`` gained since the group's last increment, as plain tuples (the
        format ``steerable.entrypoints.output_codec`` decodes and folds). ``output`` copies every
        token and character so far, O(length) per request per step; this costs O(new) and pickles
        at C speed, and carries only the completions that changed.

        ``(client_id, finished, prompt, completions, captures, capture_meta)``: ``prompt`` is
        ``(text, token_ids, prompt_logprobs, num_cached_tokens)`` in a completion's first increment (its prefill is
        done by then; after a streaming-input chunk restarted it, too), else None; each completion is ``(index, tokens_at, tokens, text_at,
        text, logprobs_at, logprobs, finish_reason, stop_reason, cumulative_logprob, captures,
        capture_meta)``, each part written from its ``*_at`` on. Tokens and logprobs only grow, text
        too except where a stop string cuts it back, hence the positions.
        """
        children = group.children
        first = children[0]
        prompt = ((first.prompt, first.prompt_token_ids, first.prompt_logprobs, first.num_cached_tokens)
                  if first.reported is None else None)
        completions = tuple(_completion_increment(r) for r in group.changed.values())
        group.changed = {}
        finished = group.finished
        if finished and group.cancelled is not None:
            completions += tuple((i, 0, [], 0, "", 0, None, group.cancelled, None, None, None, None)
                                 for i in range(len(children), group.n))
        captures, capture_meta = _merge_captures(children) if finished and group.cancelled is None else ({}, {})
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
    if any(c.finish_reason in ("abort", "error") for c in children):  # an ended group delivers none
        return {}, {}
    tensors: dict[str, dict[int, Any]] = {}
    metas: dict[str, dict[int, Any]] = {}
    for stream in children[0].captures:
        tensors[stream], metas[stream] = {}, {}
        for layer in children[0].captures[stream]:
            tensors[stream][layer] = concat_captured([c.captures[stream][layer] for c in children])
            metas[stream][layer] = CaptureMeta.concat([c.capture_meta[stream][layer] for c in children])
    return tensors, metas
