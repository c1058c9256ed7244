"""Owns the model, its KV cache and the persistent per-step device inputs; runs one forward (eager
or a CUDA-graph replay) and samples."""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch

from steerable.config import EngineConfig, ModelConfig
from steerable.engine.request import PLACEHOLDER, Request
from steerable.engine.scheduler import SchedulerOutput
from steerable.hook_points import HookPoints
from steerable.layers.attention import Attention
from steerable.layers.attention_backends import torch_ref
from steerable.models.loader import ModelSource, iter_weights
from steerable.models.registry import model_class
from steerable.worker.batch import AttentionMetadata, StepBatch, build_host_columns
from steerable.worker.cuda_graphs import CudaGraphRunner
from steerable.worker.sampler import SampleHandle, Sampler

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU when kv_cache_tokens is not given
_GRAPH_RESERVE_BYTES = 1 << 30  # kept free for CUDA-graph pools and sampler temporaries


def select_backend(name: str, device: torch.device) -> ModuleType:
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return torch_ref
    if name in ("auto", "triton"):
        from steerable.layers.attention_backends import triton_paged
        return triton_paged
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")


class InputBuffers:
    """Device tensors whose addresses never change (CUDA graphs read them), with host staging."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.tokens = torch.zeros(4, max_tokens, dtype=torch.int64, device=device)  # ids, pos, slots, steer
        self.seqs = torch.zeros(2, max_seqs + 1, dtype=torch.int32, device=device)  # query_start, seq_lens
        # Two sets of host staging, used by alternate steps: while one step's copies may still be
        # queued behind the step in flight, the next step fills the other set.
        self._tokens_host = [torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._seqs_host = [torch.zeros(2, max_seqs + 1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._slot_index_host = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.parity = 0
        # Each running request owns a row of block ids (the last row stays zero for padding); the
        # step's block table is gathered from it on the device.
        self.request_blocks = torch.zeros(max_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        self.request_blocks_host = np.zeros((max_seqs + 1, max_blocks), dtype=np.int64)
        self.block_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.slot_index = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.capture_index: list[torch.Tensor] = []
        self.max_tokens = max_tokens

    @property
    def tokens_host(self) -> torch.Tensor:
        return self._tokens_host[self.parity]

    @property
    def seqs_host(self) -> torch.Tensor:
        return self._seqs_host[self.parity]

    @property
    def slot_index_host(self) -> torch.Tensor:
        return self._slot_index_host[self.parity]

    def capture_buffers(self, count: int) -> list[torch.Tensor]:
        while len(self.capture_index) < count:
            self.capture_index.append(torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device))
        return self.capture_index[:count]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.hooks = HookPoints()
        self.backend = select_backend(config.attention_backend, device)
        cls = model_class(model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = cls(model_config, self.hooks, self.backend, max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(iter_weights(source, model_config.hf_config, dtype))
        self.model.eval().requires_grad_(False)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = InputBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, device)
        self.workspace = None
        if self.backend is not torch_ref:
            self.workspace = self.backend.DecodeWorkspace(config.max_num_seqs, model_config.num_heads,
                                                          model_config.head_dim, device)
        self.sampler = Sampler(device, config.seed)
        self.last_sampled = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64, device=device)  # per slot
        self.num_blocks = self._allocate_kv_cache()
        self.slots: dict[str, int] = {}  # running request id -> its row in request_blocks
        self.blocks_written: dict[int, int] = {}  # row -> how many of its block ids are on the device
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.graphs = None
        if (device.type == "cuda" and not config.enforce_eager and self.backend is not torch_ref
                and getattr(self.model, "supports_cuda_graphs", True)):
            self.graphs = CudaGraphRunner(self.model, config.max_num_seqs)

    # ------------------------------------------------------------ memory

    def _allocate_kv_cache(self) -> int:
        cfg = self.model_config
        layers = len(self.attention_layers)
        bytes_per_block = 2 * layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        if self.config.kv_cache_tokens is not None:
            num_blocks = self.config.kv_cache_tokens // self.block_size
        elif self.device.type == "cuda":
            num_blocks = int(self._profile_free_bytes() // bytes_per_block)
        else:
            num_blocks = _CPU_KV_BYTES // bytes_per_block
        if num_blocks < 1:
            raise ValueError("not enough memory for a single KV block; lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_tokens")
        shape = (2, layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Unwritten slots are never read (attention masks by seq_lens), so GPU memory need not be cleared.
        make = torch.empty if self.device.type == "cuda" else torch.zeros
        self.kv_cache = make(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.1f GiB)", num_blocks, self.block_size,
                    num_blocks * bytes_per_block / 2**30)
        return num_blocks

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run the largest step the scheduler can produce (with a scratch KV block) and the sampler
        on the most rows, then give the KV cache what ``gpu_memory_utilization`` leaves."""
        cfg = self.model_config
        tokens = max(self.config.max_num_batched_tokens, self.max_num_seqs)
        scratch = torch.zeros(1, self.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype,
                              device=self.device)
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = scratch
        torch.cuda.reset_peak_memory_stats(self.device)
        # Sequences of one block each, all reading the scratch block: the activations of a full
        # token budget without needing a real cache.
        lens = [self.block_size] * (tokens // self.block_size) + ([tokens % self.block_size] if tokens % self.block_size
                                                                  else [])
        seqs = min(self.max_num_seqs, len(lens))
        starts = np.concatenate([[0], np.cumsum(lens)])
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(len(lens), 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), workspace=self.workspace)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        batch = StepBatch(ids, ids, meta, torch.arange(seqs, device=self.device), [], tokens)
        hidden = self.model(ids, ids, batch)
        logits = self.model.compute_logits(hidden[:seqs]).float()  # the torch sampler path works in float32
        probs = logits.softmax(-1)
        torch.empty_like(probs).exponential_()
        del hidden, logits, probs
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - peak - outside_torch - _GRAPH_RESERVE_BYTES
        logger.info("memory profile: peak %.2f GiB, KV budget %.2f GiB", peak / 2**30, budget / 2**30)
        return int(max(budget, 0))

    # ------------------------------------------------------------ step inputs

    def _slot_rows(self, sched: SchedulerOutput) -> np.ndarray:
        """Each scheduled request's block-id row; new blocks are written to the device in one scatter."""
        for request in sched.preempted:  # its blocks are gone; a fresh row is written on resume
            self._release_slot(request.request_id)
        host = self.buffers.request_blocks_host
        rows, cols, values = [], [], []
        slots = np.empty(len(sched.scheduled), dtype=np.int64)
        for i, item in enumerate(sched.scheduled):
            request = item.request
            slot = self.slots.get(request.request_id)
            if slot is None:
                slot = self.slots[request.request_id] = self.free_slots.pop()
                self.blocks_written[slot] = 0
            written = self.blocks_written[slot]
            blocks = request.block_ids
            if len(blocks) > written:
                new = blocks[written:]
                host[slot, written:len(blocks)] = new
                rows.extend([slot] * len(new))
                cols.extend(range(written, len(blocks)))
                values.extend(new)
                self.blocks_written[slot] = len(blocks)
            slots[i] = slot
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            self.buffers.request_blocks[index[0], index[1]] = torch.tensor(values, dtype=torch.int32).to(
                self.device, non_blocking=True)
        return slots

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        slots = self._slot_rows(sched)
        cols = build_host_columns(sched.scheduled, slots, self.buffers.request_blocks_host, self.block_size)
        num_tokens, num_seqs = len(cols.token_ids), len(sched.scheduled)
        self.buffers.parity ^= 1
        padded = num_tokens
        if self.graphs is not None and cols.max_query_len == 1:
            padded = self.graphs.padded_size(num_seqs) or num_tokens
        buf = self.buffers
        host = buf.tokens_host.numpy()
        host[0, :num_tokens] = cols.token_ids
        host[1, :num_tokens] = cols.positions
        host[2, :num_tokens] = cols.slot_mapping
        host[:, num_tokens:padded] = 0
        host[2, num_tokens:padded] = -1
        pending = np.flatnonzero(cols.token_ids == PLACEHOLDER)
        host[0, pending] = 0
        buf.tokens[:3, :padded].copy_(buf.tokens_host[:3, :padded], non_blocking=True)
        if len(pending):  # tokens sampled by the step still in flight: taken from the device
            rows = torch.from_numpy(pending).to(self.device, non_blocking=True)
            owners = torch.from_numpy(slots[cols.token_req[pending]]).to(self.device, non_blocking=True)
            buf.tokens[0].index_copy_(0, rows, self.last_sampled.index_select(0, owners))
        seq_host = buf.seqs_host.numpy()
        pad_seqs = padded if padded != num_tokens else num_seqs  # a padded decode row is a sequence
        seq_host[0, :num_seqs + 1] = cols.query_start
        seq_host[0, num_seqs + 1:pad_seqs + 1] = np.arange(num_tokens + 1, padded + 1)
        seq_host[1, :num_seqs] = cols.seq_lens
        seq_host[1, num_seqs:pad_seqs] = 0
        buf.seqs[:, :pad_seqs + 1].copy_(buf.seqs_host[:, :pad_seqs + 1], non_blocking=True)
        slot_host = buf.slot_index_host.numpy()
        slot_host[:num_seqs] = slots
        slot_host[num_seqs:pad_seqs] = self.max_num_seqs  # the all-zero padding row
        buf.slot_index[:pad_seqs].copy_(buf.slot_index_host[:pad_seqs], non_blocking=True)
        block_table = buf.block_table[:pad_seqs]
        torch.index_select(buf.request_blocks, 0, buf.slot_index[:pad_seqs], out=block_table)
        attn = AttentionMetadata(buf.tokens[2, :padded], buf.seqs[0, :pad_seqs + 1], buf.seqs[1, :pad_seqs],
                                 block_table, cols.max_query_len, self.workspace)
        sample_rows = torch.from_numpy(cols.sample_rows).to(self.device, non_blocking=True)
        return StepBatch(buf.tokens[0, :padded], buf.tokens[1, :padded], attn, sample_rows, sched.scheduled,
                         num_tokens, cols)

    def bind_planes(self, batch: StepBatch) -> None:
        """Move the planes' host plans (steering row per token, capture rows per group) into the
        persistent index buffers the hook points read."""
        padded = batch.num_padded_tokens
        steering = batch.steering
        if steering is not None:
            host = self.buffers.tokens_host.numpy()
            host[3, :batch.num_tokens] = steering.host_index
            host[3, batch.num_tokens:padded] = 0
            self.buffers.tokens[3, :padded].copy_(self.buffers.tokens_host[3, :padded], non_blocking=True)
            steering.index = self.buffers.tokens[3, :padded]
        capture = batch.capture
        if capture is not None:
            graphed = self.graphs is not None and self.graphs.can_run(batch)
            buffers = self.buffers.capture_buffers(len(capture.groups))
            for group, buffer in zip(capture.groups, buffers):
                rows = torch.from_numpy(group.rows)
                buffer[:len(rows)].copy_(rows, non_blocking=True)
                # A graph gathers a fixed number of rows; the padding ones are dropped on delivery.
                buffer[len(rows):padded].zero_()
                group.index = buffer[:padded] if graphed else buffer[:len(rows)]

    # ------------------------------------------------------------ forward + sample

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> SampleHandle | None:
        """Enqueue the forward and the sampler; the tokens stay on the device (and are kept per
        request row for the next step's inputs) until ``finish`` reads them."""
        logits = self.forward(batch)
        sampling = [s for s in batch.scheduled if s.samples]
        if not sampling:
            return None
        handle = self.sampler.sample(logits, [s.request for s in sampling])
        owners = torch.from_numpy(batch.host.slots[[s.samples for s in batch.scheduled]])
        self.last_sampled.index_copy_(0, owners.to(self.device, non_blocking=True), handle.tokens)
        return handle

    def finish(self, handle: SampleHandle | None) -> tuple[list[int], list[dict | None]]:
        """Wait for a launched step's samples and bring them to the host."""
        if handle is None:
            return [], []
        return self.sampler.finalize(handle)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (model dtype) of the rows that sample this step."""
        batch.graphed = self.graphs is not None and self.graphs.can_run(batch)
        if batch.graphed:
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def add_request(self, request: Request) -> None:
        self.sampler.add_request(request)

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the graphs so their device memory can be reused."""
        self.graphs = None
        self.model = None
        self.kv_cache = None
        self.attention_layers = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def remove_request(self, request: Request) -> None:
        self.sampler.remove_request(request.request_id)
        self._release_slot(request.request_id)

    def _release_slot(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            del self.blocks_written[slot]
            self.free_slots.append(slot)
