"""Admission, the part of the engine that turns ``add_request`` into scheduled requests: input
checks (every bad field a ``ValueError`` naming it, before anything is allocated), tokenization,
each completion's steering, structured-output and capture state, and ``n`` > 1 groups whose
siblings are created as the batch has room, sharing the first one's prompt KV. ``LLM.generate``'s
prompts are checked up front, then queued and admitted as the scheduler takes them
(``QueuedPrompts``)."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from steerable.checks import all_ints, is_int
from steerable.engine.output_processor import RequestGroup
from steerable.errors import InvalidRequestError
from steerable.request import Request
from steerable.sampling_params import SamplingParams
from steerable.steering.spec import Intervention
from steerable.structured.plane import refuse_streaming_input


@dataclass
class CheckedPrompt:
    """A prompt that passed every check admission makes (``Admission._check``): its tokens and its
    own steering, parsed. Admitting it builds its state and can no longer refuse it."""

    client_id: str
    prompt_text: str | None
    token_ids: list[int]
    params: SamplingParams
    steering: list[Intervention]
    stop_at_layer: int | None = None


@dataclass
class QueuedPrompts:
    """One call's prompts, checked up front (a bad one refuses the call before any of them runs:
    nothing of it reaches a stream, a consumer or a counter), then admitted in order when the
    scheduler has room and no other request waits: building their steering, capture and grammar
    state then runs while the device works on the steps before, and every step is the one
    admitting them all up front would have built (the scheduler takes waiting requests first come,
    first served, and asks for the next only once none is left). A prompt that admission refuses
    after all (what it names changed since: an SAE unregistered by another thread) ends the queue
    and is kept in ``error``."""

    entries: deque[CheckedPrompt]
    error: InvalidRequestError | None = None


class Admission:
    """Mixed into ``LLMEngine``: what ``add_request`` (and the fan-out of ``n`` completions in
    the loop) runs under the engine lock."""

    def _add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None,
                     stream: bool, resumable: bool, increments: bool, stop_at_layer: int | None = None) -> RequestGroup:
        checked = self._check(client_id, prompt, params, resumable, stop_at_layer)
        return self._admit_checked(checked, stream, resumable, increments)

    def _check(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None,
               resumable: bool = False, stop_at_layer: int | None = None,
               params_checked: bool = False) -> CheckedPrompt:
        """Every check of one prompt (each bad field a ``ValueError`` naming it), holding nothing.
        ``params_checked``: ``params`` already passed ``_check_params`` with these arguments."""
        params = params if params is not None else SamplingParams()
        if not params_checked:
            self._check_params(params, resumable, stop_at_layer)
        if client_id in self.groups:
            raise InvalidRequestError(f"request_id: {client_id!r} is already running")
        prompt_text, token_ids = self._tokenize(prompt, truncate=params.truncate_prompt_tokens)
        steering = self.steering.parse_request(params)
        return CheckedPrompt(client_id, prompt_text, token_ids, params, steering, stop_at_layer)

    def _check_params(self, params: SamplingParams, resumable: bool, stop_at_layer: int | None) -> None:
        """The checks that depend on the parameters alone: a batch sharing one object runs them once."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if resumable and params.n != 1:
            raise InvalidRequestError(f"n: streaming input takes one completion, got n={params.n}")
        if resumable and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs: not supported with streaming input")
        if resumable:
            refuse_streaming_input(params)
        if stop_at_layer is not None:
            self._check_stop(stop_at_layer, params, resumable)
        self._check_token_ids(params)
        self.structured.check(params)
        limit = self.config.max_n
        if limit is not None and params.n > limit:
            raise InvalidRequestError(f"n: {params.n} is above this engine's cap of {limit} completions per request "
                                      "(max_n)")
        self.capture.check(params)

    def _admit_checked(self, checked: CheckedPrompt, stream: bool, resumable: bool, increments: bool) -> RequestGroup:
        client_id, params = checked.client_id, checked.params
        if params.n == 1:
            first = self._admit(client_id, 0, checked.prompt_text, checked.token_ids, params, steering=checked.steering)
            if checked.stop_at_layer is not None:
                first.stop_at_layer = checked.stop_at_layer
                # its KV above the layer is never written: its blocks are no other request's prefix
                first.hash_keys.append((0, b"stop:%d" % checked.stop_at_layer))
            group = RequestGroup(client_id, [first], stream, increments)
        else:
            group = self._admit_group(checked, stream, increments)
        self.groups[client_id] = group
        for child in group.children:
            self._enqueue(child, group, resumable)
        return group

    def _queue_checked(self, requests: Sequence[tuple[str, str | Sequence[int], SamplingParams]],
                       stop_at_layer: int | None = None) -> QueuedPrompts:
        """Check every prompt of a call (the first bad one raises, nothing is queued), then queue them."""
        checked_params: set[int] = set()  # ids of the call's parameter objects already checked (alive during it)

        def check(client_id: str, prompt: str | Sequence[int], params: SamplingParams | None) -> CheckedPrompt:
            if params is not None and id(params) not in checked_params:
                self._check_params(params, False, stop_at_layer)
                checked_params.add(id(params))
            return self._check(client_id, prompt, params, stop_at_layer=stop_at_layer, params_checked=params is not None)

        batch = QueuedPrompts(deque(check(*request) for request in requests))
        self._queued.append(batch)
        return batch

    def _admit_queued(self) -> bool:
        """The scheduler's refill: admit the oldest queued prompt; False when none is left."""
        while self._queued:
            batch = self._queued[0]
            if not batch.entries:
                self._queued.popleft()
                continue
            checked = batch.entries.popleft()
            try:
                self._admit_checked(checked, False, False, False)
            except InvalidRequestError as err:
                batch.error = err
                batch.entries.clear()
                continue
            return True
        return False

    def _drop_queued(self, client_ids: set[str]) -> None:
        """Aborted before their turn: never admitted."""
        for batch in self._queued:
            batch.entries = deque(e for e in batch.entries if e.client_id not in client_ids)

    def _num_queued(self) -> int:
        return sum(len(batch.entries) for batch in self._queued)

    def _check_stop(self, stop_at_layer: Any, params: SamplingParams, resumable: bool) -> None:
        """A request that stops below the last layer has no logits: it asks for one token (a
        placeholder it discards), no prompt logprobs, one completion, no streaming input."""
        layers = self.model_config.num_layers
        if not is_int(stop_at_layer) or not 0 <= stop_at_layer <= layers:
            raise InvalidRequestError(f"stop_at_layer: expected a layer count in [0, {layers}], got {stop_at_layer!r}")
        if params.max_tokens != 1 or params.n != 1 or params.prompt_logprobs is not None or resumable:
            raise InvalidRequestError("stop_at_layer: the request computes no logits; it takes max_tokens=1, n=1, "
                                      "no prompt_logprobs and no streaming input (its token is a placeholder)")

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the parameters name entries of this model's vocabulary."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logprob_token_ids", params.logprob_token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = [t for t in ids or [] if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token ids {bad[:5]} are out of vocabulary "
                                          f"(ids are in [0, {vocab}))")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise InvalidRequestError(f"prompt_logprobs: {params.prompt_logprobs} exceeds the vocabulary size {vocab}")

    def _admit(self, client_id: str, index: int, prompt_text: str | None, token_ids: list[int],
               params: SamplingParams, template: Request | None = None,
               steering: list[Intervention] | None = None) -> Request:
        """One completion's request, its steering and capture admitted (``template``: a sibling's
        steering snapshot is shared, as the group was admitted with it; ``steering``: its own
        interventions, parsed when it was checked)."""
        request = self._new_request(client_id, index, prompt_text, token_ids, params)
        if template is None:
            self.steering.admit(request, steering)
        else:
            self.steering.share(request, template)
            request.hash_keys = list(template.hash_keys)
        try:
            self.structured.admit(request)  # compiled already (``structured.check``): cannot fail here
            self.capture.admit(request)
        except BaseException:
            self.structured.release(request)
            self.steering.release(request)
            raise
        request.detokenizer = self.tokenizer.stream(token_ids, params.skip_special_tokens)
        if request.prompt_logprobs is not None and len(token_ids) > 1:
            self._prompt_logprobs.add(request.request_id)
        return request

    def _new_request(self, client_id: str, index: int, prompt_text: str | None, token_ids: list[int],
                     params: SamplingParams) -> Request:
        request_id = f"{client_id}-{self._rng.getrandbits(32):08x}"
        return Request(request_id, client_id, prompt_text, token_ids, params, self._rng.getrandbits(63),
                       self.model_config.eos_token_ids, index)

    def _admit_group(self, checked: CheckedPrompt, stream: bool, increments: bool) -> RequestGroup:
        """``n`` > 1: the steering snapshot is taken once, on a template request that is never
        scheduled, and the first completion admitted now (so bad input fails here); the others
        are created from the template as the scheduler has room (``_fan_out``)."""
        client_id, prompt_text, token_ids, params = (checked.client_id, checked.prompt_text, checked.token_ids,
                                                     checked.params)
        template = self._new_request(client_id, -1, prompt_text, token_ids, params)
        self.steering.admit(template, checked.steering)
        try:
            first = self._admit(client_id, 0, prompt_text, token_ids, _child_params(params, 0), template)
        except BaseException:
            self.steering.release(template)
            raise
        group = RequestGroup(client_id, [first], stream, increments, n=params.n)
        group.template = template
        block = self.config.block_size
        caching = self.config.enable_prefix_caching and not params.skip_reading_prefix_cache
        group.shared_blocks = (len(token_ids) - 1) // block if caching else 0
        self._fanning_out.append(group)
        return group

    def _enqueue(self, child: Request, group: RequestGroup, resumable: bool = False) -> None:
        child.group = group
        child.resumable = resumable
        self.requests[child.request_id] = child
        self.scheduler.add(child)

    def _fan_out(self) -> None:
        """Create the next siblings of ``n``-requests, oldest first, while the batch has free
        sequence slots not claimed by requests already waiting: a request that arrives later
        waits behind at most one such batch. One request's live completions stay within
        ``max_fanout_seqs``, so the others keep the rest of the batch. Siblings wait until the
        first one's prompt blocks are in the prefix cache, so they share its KV instead of
        computing the prompt again."""
        waiting = len(self.scheduler.waiting) + self._num_queued()  # queued prompts count as waiting
        room = self.config.max_num_seqs - len(self.scheduler.running) - waiting
        cap = self.config.max_fanout_seqs or self.config.max_num_seqs
        for group in list(self._fanning_out):
            if room <= 0:
                return
            first = group.children[0]
            if group.shared_blocks and not first.finished and self.kv.num_published(first) < group.shared_blocks:
                continue
            take = min(room, group.num_uncreated, cap - (group.num_unfinished - group.num_uncreated))
            if take <= 0:
                continue
            self._fanning_out.remove(group)
            while self._admit_queued():  # queued prompts wait ahead of the siblings, as admitted ones would
                pass
            template = group.template
            for _ in range(take):
                index = len(group.children)
                child = self._admit(group.client_id, index, template.prompt, template.prompt_token_ids,
                                    _child_params(template.params, index), template)
                group.children.append(child)
                group.changed[index] = child
                self._enqueue(child, group)
                room -= 1
            if group.num_uncreated:
                self._fanning_out.append(group)  # behind the others, and behind requests that arrive meanwhile
            else:
                self._release_template(group)

    def _release_template(self, group: RequestGroup) -> None:
        if group.template is not None:
            self.steering.release(group.template)
            group.template = None

    def _tokenize(self, prompt: str | Sequence[int], continuation: bool = False,
                  truncate: int | None = None) -> tuple[str | None, list[int]]:
        """Token ids of a prompt, or of a streaming-input chunk (``continuation``: no special
        tokens; its length is checked when it is applied); ``truncate``: keep the last that many
        (-1: the most ``max_model_len`` leaves room for, one token to generate)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=not continuation)
        else:
            text, ids = None, list(prompt)
            if not all_ints(ids):
                raise InvalidRequestError("prompt: token-id prompts must be lists of integers")
        if not ids:
            raise InvalidRequestError("prompt: must contain at least one token")
        if truncate is not None:
            keep = self.max_model_len - 1 if truncate == -1 else truncate
            if keep < len(ids):
                text, ids = None, ids[len(ids) - keep:]
        vocab = self.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # two passes in C; the list names the culprits
            bad = [t for t in ids if not 0 <= t < vocab]
            raise InvalidRequestError(f"prompt: token ids {bad[:5]} are out of vocabulary (ids are in [0, {vocab}))")
        if not continuation and len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt: {len(ids)} tokens do not fit max_model_len={self.max_model_len} "
                                      "(at least one token must be generated)")
        return text, ids


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of ``n``: its own copy, seeded ``seed + index`` as vLLM seeds siblings."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)
