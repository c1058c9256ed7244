"""The plain messages between the driver and a worker: one ``StepInput`` per step in, one
``StepOutput`` per step back.

Only numpy arrays, numbers, strings and small dataclasses of them: what a tensor-parallel worker
process receives over the wire, and what every rank turns into the same decisions (which CUDA
graph to replay, which rows to gather). Nothing in here refers to engine objects.

``to_device`` is how a worker lands a message's arrays on its device: from page-locked memory, so
the copy never waits for the step in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

PLACEHOLDER = -1  # a token id sampled by the previous step, still on the device

Site = tuple[str, int]  # (hook point, layer)


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``, copied without a stream sync on CUDA.

    A copy from pageable host memory first waits for the stream to drain, so the host would sit
    idle until the step in flight ends instead of preparing the next one; PyTorch's caching host
    allocator reuses a pinned block only once its copy has finished. On a CPU device the array is
    used as it is."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class BlockTableUpdate:
    """New KV block ids: ``request_blocks[g, rows[i], cols[i]] = values[g, i]`` in the worker's table
    of each KV group g (``steerable.kv_groups``)."""

    rows: np.ndarray  # int64 [n]
    cols: np.ndarray  # int64 [n]
    values: np.ndarray  # int64 [G, n]


@dataclass
class PenaltyInput:
    """A sampling row with penalties, and the tokens they count (all known on the host)."""

    row: int  # index into the step's sampled rows
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    repetition: float
    frequency: float
    presence: float


@dataclass
class PromptLogprobsInput:
    """Rows of one request whose next-token distributions over its own prompt are reported
    (``SamplingParams.prompt_logprobs``): the logprob and rank of the prompt token each row
    predicts, and the ``num`` most likely tokens."""

    request: int  # index into the step's requests
    position: int  # the position of the first row (its prediction is of the token at position + 1)
    rows: np.ndarray  # int64 [R]: token rows of this step
    targets: np.ndarray  # int64 [R]: the prompt token each row predicts
    num: int


@dataclass
class SamplingInput:
    """Per sampled row: which token row it reads, whose slot keeps the token, and how to draw."""

    rows: np.ndarray  # int64 [S]: token rows whose logits are sampled
    slots: np.ndarray  # int64 [S]: the request slot that keeps the sampled token for the next step
    temperature: np.ndarray  # float32 [S]; 0 is greedy
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int64 [S]; 0 disables
    min_p: np.ndarray  # float32 [S]
    seeds: np.ndarray  # int64 [S]: noise key, a function of the request's seed and the position sampled
    logprobs: list[tuple[int, list[int]] | None]  # (top-N, or -1 for all; ids always reported)
    suppress: dict[int, np.ndarray] = field(default_factory=dict)  # row -> token ids masked (min_tokens)
    logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # row -> (ids, biases)
    allowed: dict[int, np.ndarray] = field(default_factory=dict)  # row -> the only token ids it may sample
    penalties: list[PenaltyInput] = field(default_factory=list)
    # Structured outputs: the sampled rows under a grammar, and their packed allowed-token masks
    # (int32 [len(grammar_rows), ceil(V / 32)], bit t % 32 of word t // 32 for token t).
    grammar_rows: np.ndarray | None = None
    grammar_bitmask: np.ndarray | None = None

    @property
    def filtered(self) -> bool:
        """Some row needs top-k, top-p or min-p (the torch path)."""
        return bool(self.top_k.any() or (self.top_p < 1.0).any() or self.min_p.any())


NO_CLAMP = (-math.inf, math.inf, 0.0, 1.0)  # lo, hi, strength, factor of an unused clamp slot: it changes nothing
CLAMP_PARAMS = len(NO_CLAMP)  # bounds per clamp slot
NO_GATE = (0.0, -math.inf)  # bias, threshold of a projection clamp: it reads a = h·d


@dataclass
class TableWrite:
    """Where one site's new rows lie in a ``SteeringUpdate``. ``table``: "add" (``n`` vectors) or
    "clamp" (``n * slots`` read directions and as many bounds -- lo, hi, strength, factor; with
    ``split``, as many write directions after the read ones and gates -- bias, threshold -- after the
    bounds) or "tclamp" (a transcoder clamp: a split clamp whose slots each write ``span`` directions,
    one per ``mlp_out`` from the source layer on)."""

    table: str
    point: str
    layer: int
    rows: int  # index of its first row in the update's row indices
    n: int
    vectors: int  # index of its first vector among the update's vector indices
    params: int = 0  # offset of its first bound among the update's params
    slots: int = 1
    split: bool = False
    span: int = 1

    @property
    def site(self) -> Site:
        return self.point, self.layer

    @property
    def count(self) -> int:
        """Vectors in each of its parts (and bounds, gates): one per row of an add, one per slot of a clamp."""
        return self.n * self.slots

    @property
    def row_span(self) -> slice:
        """Its rows among the update's row indices."""
        return slice(self.rows, self.rows + self.n)

    def vector_span(self, written: bool = False) -> slice:
        """Its vectors among the update's vector indices: the added or read ones, or (``written``,
        a split clamp) the written ones after them."""
        start = self.vectors + (self.count if written else 0)
        return slice(start, start + self.count * (self.span if written else 1))

    @property
    def bound_span(self) -> slice:
        """Its clamp bounds among the update's params (``CLAMP_PARAMS`` per slot)."""
        return slice(self.params, self.params + CLAMP_PARAMS * self.count)

    @property
    def gate_span(self) -> slice:
        """Its gates among the update's params (two per slot, after the bounds)."""
        start = self.params + CLAMP_PARAMS * self.count
        return slice(start, start + 2 * self.count)


@dataclass
class SteeringUpdate:
    """Changes to the worker's steering tables since the last step, applied before its forward.

    ``capacity``: rows every table must hold (tables only grow). The rest travels in one float32
    buffer, so the worker makes one host-to-device copy per update whatever the number of sites:
    ``data`` holds every write's row indices (``num_rows``) and vector indices (``num_pieces``,
    both as int32 bits), the clamp bounds and gates (``num_params`` values), then each distinct
    vector once (``hidden`` values each, float32; a config's one vector at every layer is sent
    once and gathered on the device). ``writes`` say which part belongs to which site's table.
    New contents cover every slot of a row: zeros, ``NO_CLAMP`` and ``NO_GATE`` clear what it left.
    """

    capacity: int
    hidden: int = 0
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    writes: list[TableWrite] = field(default_factory=list)
    num_rows: int = 0
    num_pieces: int = 0
    num_params: int = 0
    edits: list[EditWrite] = field(default_factory=list)  # the low-rank, dense, gate and router tables'

    @property
    def empty(self) -> bool:
        return not self.writes and not self.edits

    @property
    def params_at(self) -> int:
        return self.num_rows + self.num_pieces

    @property
    def vectors_at(self) -> int:
        return self.params_at + self.num_params

    def split(self, data: Any) -> tuple[Any, Any, Any]:
        """This update's buffer (``data``: on the host, or copied to a device) cut into its parts:
        the row then vector indices (int32 bits, ``num_rows`` first), the params, and the distinct
        vectors [m, hidden]. ``TableWrite``'s spans index into them."""
        return (data[:self.params_at], data[self.params_at:self.vectors_at],
                data[self.vectors_at:].reshape(-1, self.hidden))

    def rows(self, write: TableWrite) -> np.ndarray:
        """int64 [n]: the rows ``write`` sets."""
        bits, _, _ = self.split(self.data)
        return bits[:self.num_rows][write.row_span].view(np.int32).astype(np.int64)

    def vectors(self, write: TableWrite) -> np.ndarray:
        """float32 [n, H] (an add) or [n, slots, H] (a clamp's read directions)."""
        bits, _, distinct = self.split(self.data)
        block = distinct[bits[self.num_rows:][write.vector_span()].view(np.int32)]
        return block.reshape(write.n, self.hidden) if write.table == "add" else \
            block.reshape(write.n, write.slots, self.hidden)

    def bounds(self, write: TableWrite) -> np.ndarray:
        """float32 [n, slots, CLAMP_PARAMS]: a clamp's lo, hi, strength, factor."""
        _, params, _ = self.split(self.data)
        return params[write.bound_span].reshape(write.n, write.slots, CLAMP_PARAMS)


@dataclass(frozen=True)
class EditSites:
    """Where a step runs the steering ops beyond adds and clamps: low-rank and dense edits
    (``edit``), ``When`` gates (``gates``; ``prompt_gates``: those that decide over a prompt's rows)
    and router biases (``router``, at ``router_logits`` sites)."""

    edit: frozenset[Site] = frozenset()
    gates: frozenset[Site] = frozenset()
    prompt_gates: frozenset[Site] = frozenset()
    router: frozenset[Site] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.edit or self.gates or self.router)


@dataclass
class EditWrite:
    """New rows of one site's edit table (``steering.edit_rows`` says what each array holds).
    ``table``: "edit" (rows' low-rank parts at rank ``width``, constants and dense slots), "dense"
    (``rows`` are slots of the site's ``width`` dense matrices), "gate" (``width`` gate slots per
    row) or "router" (``width`` experts)."""

    table: str
    point: str
    layer: int
    rows: np.ndarray  # int64 [n]
    width: int
    arrays: list[np.ndarray]

    @property
    def site(self) -> Site:
        return self.point, self.layer


@dataclass
class SteeringPlan:
    """Which table row each token uses (0: none) and what a CUDA graph bakes in: the op at each
    site and the table layout version (a table reallocated by growth lives elsewhere)."""

    index: np.ndarray  # int64 [T]
    add_sites: frozenset[Site]
    clamp_sites: frozenset[Site]
    version: int
    tclamp_sites: frozenset[Site] = frozenset()  # transcoder clamps, by the site where they read
    edits: EditSites | None = None

    @property
    def signature(self) -> tuple:
        return self.add_sites, self.clamp_sites, self.tclamp_sites, self.edits, self.version


@dataclass
class CaptureGroup:
    """Rows to gather at ``hook`` of each of ``layers``, stored as ``dtype`` (None: the model's);
    ``heads``: the query heads an attention-pattern group keeps (None: all). With ``sae`` (a key of
    the worker's SAE tables) the rows are encoded on the device and each keeps its ``top_k`` highest
    features: float32 ``[indices as int32 bits | values]`` (a transcoder's flat indices, per layer).
    ``hook == "transcoder_error"``: the transcoder ``sae``'s error node at each of ``layers``, float32
    rows of the hidden size, from what it reads and the MLP's output."""

    hook: str
    layers: tuple[int, ...]
    dtype: str | None
    rows: np.ndarray  # int64, sorted step rows
    heads: tuple[int, ...] | None = None
    sae: str | None = None
    top_k: int = 0

    @property
    def signature(self) -> tuple:
        return self.hook, self.layers, self.dtype, self.heads, self.sae, self.top_k


@dataclass
class SaeWeights:
    """What a worker needs to encode rows with one SAE (its decoder stays on the driver):
    ``pre = (x - b_dec_in) @ W_enc + b_enc`` (b_dec_in None: nothing subtracted), then the
    ``architecture``'s activation."""

    layer: int
    hook: str
    architecture: str  # "relu" | "jumprelu" | "topk"
    k: int  # the SAE's own k for "topk", else 0
    W_enc: torch.Tensor  # [d_in, d_sae], the model dtype
    b_enc: torch.Tensor  # float32 [d_sae]
    threshold: torch.Tensor | None = None  # float32 [d_sae] for "jumprelu"
    b_dec_in: torch.Tensor | None = None  # float32 [d_in]


@dataclass
class TranscoderWeights:
    """What a worker needs to encode rows with a transcoder: one encoder per source layer (``layer``
    on), each read at ``hook``."""

    layer: int
    hook: str
    encoders: list[SaeWeights]


@dataclass
class TranscoderDecoders:
    """What a worker needs besides to compute a transcoder's error node: per source layer its
    decoders ``[d_tc, span, d_out]`` (the model dtype), per output layer ``b_dec`` (float32 [n, d_out])
    and the skip term ``W_skip [n, d_in, d_out]`` (None: none)."""

    W_dec: list[torch.Tensor]
    b_dec: torch.Tensor
    W_skip: torch.Tensor | None = None


@dataclass
class SaeUpdate:
    """SAEs and transcoders registered (``add``, ``transcoders``, by key), transcoder decoders shipped
    for an error capture (``decoders``), and keys unregistered (``remove``) since the last step."""

    add: dict[str, SaeWeights] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)
    transcoders: dict[str, TranscoderWeights] = field(default_factory=dict)
    decoders: dict[str, TranscoderDecoders] = field(default_factory=dict)


@dataclass
class CapturePlan:
    groups: list[CaptureGroup]

    @property
    def signature(self) -> tuple:
        """The shape of the plan a CUDA graph bakes in (row contents and counts are data)."""
        return tuple(g.signature for g in self.groups)


@dataclass
class SharedPrefix:
    """Decode rows that hold the same leading KV blocks of one full-attention KV group: attention
    reads those blocks once for all of them (``attention_backends.shared_prefix``). In a step that
    mixes prefill chunks in, those chunks have length 0 here."""

    group: int  # the KV group whose block tables share the prefix
    lengths: np.ndarray  # int64 [B]: shared tokens of each row (whole blocks), 0 outside the group


@dataclass
class StepInput:
    """Everything a worker needs for one forward and its sampling."""

    step_id: int
    token_ids: np.ndarray  # int64 [T]; PLACEHOLDER: the token its request sampled last step
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [G, T]: KV cache slot of each token in each KV group
    query_start: np.ndarray  # int64 [B + 1]
    seq_lens: np.ndarray  # int64 [B]
    request_slots: np.ndarray  # int64 [B]: each request's row in the worker's block table
    max_query_len: int
    block_update: BlockTableUpdate | None = None
    sampling: SamplingInput | None = None
    steering_update: SteeringUpdate | None = None
    steering: SteeringPlan | None = None
    capture: CapturePlan | None = None
    shared_prefix: SharedPrefix | None = None  # rows of one query token only (0 for prefill chunks)
    prompt_logprobs: list[PromptLogprobsInput] | None = None
    sae_update: SaeUpdate | None = None
    # Every request of the step wants rows only up to this layer and discards its token: the layers
    # from it up, the logits and the sampler are skipped (placeholder tokens come back).
    stop_at_layer: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def token_request(self) -> np.ndarray:
        """int64 [T]: which request (index into this step) each token belongs to."""
        return np.repeat(np.arange(self.num_requests), np.diff(self.query_start))


@dataclass
class StepOutput:
    step_id: int
    sampled: list[int]
    logprobs: list[dict[int, tuple[float, int]] | None]
    captured: list[torch.Tensor]  # per capture group: its rows on the host, [layers, rows, width]
    graphed: bool
    # Per PromptLogprobsInput of the step: the targets' logprobs [R] and ranks [R], the top ids and
    # logprobs [R, num].
    prompt_logprobs: list[list[np.ndarray]] = field(default_factory=list)


class Worker(Protocol):
    """What the engine drives: one model runner, or an executor over several ranks. ``launch``
    enqueues a step and returns a handle; ``finish`` waits for it. Several steps may be launched
    before the first is finished; they finish in launch order."""

    num_blocks: int  # KV blocks every rank holds
    max_blocks_per_seq: int
    # Later capture-copying launches a step's host rows outlive; None: only until the next finish.
    host_block_lifetime: int | None

    def launch(self, step: StepInput) -> Any: ...

    def finish(self, launched: Any) -> StepOutput: ...

    def stats(self) -> dict[str, int]: ...

    def shutdown(self) -> None: ...
