"""A request's lifetime state, and the scheduler's decisions about it.

Neutral ground: the engine (driver) owns these objects; the steering and capture planes read them
when they admit a request and when they plan a step. The worker never sees them: it receives a
plain ``StepInput`` (``steerable.step``).
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from steerable.sampling_params import SamplingParams


def _no_group() -> None:
    return None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # streaming input: a chunk is done, the next one has not been applied yet
    FINISHED = "finished"


class Request:
    """Tokens, KV blocks and progress of one sequence (one of the ``n`` completions of a group).

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the scheduler asks for the rest.
    After a recompute preemption it drops to 0 and the prompt *and* the generated tokens are
    prefilled again, so a preempted request resumes exactly where it stopped.
    """

    def __init__(self, request_id: str, client_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, sampling_seed: int, eos_token_ids: list[int], index: int = 0):
        self.request_id = request_id
        self.client_id = client_id
        self.index = index  # which of the group's completions this is
        self._group: Callable[[], Any] = _no_group  # a weak reference to the engine's RequestGroup
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.sampling_seed = sampling_seed
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing PLACEHOLDER tokens in all_token_ids
        # Highest num_computed_tokens ever reached: rows below it were already delivered to capture.
        self.max_computed_tokens = 0
        self.block_ids: list[list[int]] = []  # one list per KV group (steerable.kv_groups); [] holds none
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first scheduling
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.eos_token_ids = set(eos_token_ids)
        self.output_text = ""
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # Per prompt token, its logprob entries (the first has none); one completion of a group reports them.
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.cumulative_logprob = 0.0
        self.detokenizer: Any = None
        # (tokens, characters, logprobs) of the output already sent as increments; None before the
        # first (``OutputProcessor.increment``).
        self.reported: tuple[int, int, int] | None = None
        # Prefix-cache identity beyond the tokens: (first position affected, key). A block's hash
        # includes every key whose position falls inside or before it (cache salt from 0, steering
        # from the first steered position), so unaffected leading blocks stay shareable.
        self.hash_keys: list[tuple[int, bytes]] = []
        if params.cache_salt is not None:
            self.hash_keys.append((0, b"salt:" + params.cache_salt.encode()))
        # Rows wanted only up to this layer (``add_request``'s ``stop_at_layer``); None: every layer.
        self.stop_at_layer: int | None = None
        # Streaming input (``resumable``): a finished chunk pauses the request, keeping its KV blocks
        # and plane registrations; queued chunks (token ids, params) resume it, until input closes.
        self.resumable = False
        self.chunks: deque[tuple[list[int], SamplingParams]] = deque()
        self.input_closed = False
        self.steering: Any = None  # steering plane's per-request state (resolved config, rows)
        self.capture: Any = None  # capture plane's per-request state
        self.grammar: Any = None  # structured outputs: this completion's matcher (steerable.structured)
        self.captures: dict = {}  # delivered on the final RequestOutput
        self.capture_meta: dict = {}

    @property
    def group(self) -> Any:
        """The engine's ``RequestGroup`` of this completion. Held weakly: the group holds its
        children, and a cycle would leave every finished request to the cyclic collector."""
        return self._group()

    @group.setter
    def group(self, group: Any) -> None:
        self._group = weakref.ref(group)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known on the host (without placeholders of steps still in flight)."""
        return self.all_token_ids[len(self.prompt_token_ids):self.num_tokens - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def paused(self) -> bool:
        return self.status is RequestStatus.PAUSED

    @property
    def more_input(self) -> bool:
        """A streaming-input request with chunks queued or its input still open."""
        return self.resumable and not (self.input_closed and not self.chunks)

    def drop_pending(self) -> None:
        """Forget the tokens of steps still in flight: they will be discarded."""
        if self.num_pending:
            del self.all_token_ids[self.num_tokens - self.num_pending:]
            self.num_pending = 0

    def grow(self, chunk: list[int], params: SamplingParams) -> int:
        """Apply a streaming-input chunk (vLLM's resumable requests): the last sampled token, which
        has no KV yet, is dropped; the rest of the output joins the prompt, then ``chunk``; the
        generation state starts over under ``params``. Returns where the kept tokens end."""
        keep = self.num_tokens - 1
        del self.all_token_ids[keep:]
        self.num_computed_tokens = min(self.num_computed_tokens, keep)
        self.max_computed_tokens = min(self.max_computed_tokens, keep)  # the dropped row was never delivered
        self.prompt = None
        self.prompt_token_ids = self.all_token_ids + chunk
        self.all_token_ids = list(self.prompt_token_ids)
        self.params = params
        self.finish_reason = self.stop_reason = None
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(self.eos_token_ids)
        self.output_text = ""
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.reported = None  # the completion starts over, and the prompt has grown
        self.hash_keys.append((keep, b"resume@%d" % keep))  # its KV from here on is the session's own
        self.status = RequestStatus.WAITING
        return keep

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")



@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # this chunk reaches the end of the known tokens, so its last row is sampled
    token_index: int = -1  # where the sampled token goes in request.all_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
