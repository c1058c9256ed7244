"""The worker: owns the model, its KV cache, the persistent per-step device inputs, the device
halves of the steering and capture planes, and the sampler. Each step it takes one plain
``StepInput``, runs one forward (eager or a CUDA-graph replay) and samples; ``finish`` hands back
a plain ``StepOutput``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import numpy as np
import torch

from steerable.capture.gather import CaptureBuffers
from steerable.config import EngineConfig, ModelConfig
from steerable.hook_points import HookPoints
from steerable.layers import fused
from steerable.layers.attention import Attention
from steerable.layers.attention_backends import torch_ref
from steerable.models.loader import ModelSource, dummy_weights, iter_weights
from steerable.models.registry import model_class
from steerable.step import StepInput, StepOutput
from steerable.steering.tables import SteeringTables
from steerable.worker.cuda_graphs import CudaGraphRunner
from steerable.worker.forward_context import AttentionMetadata, ForwardContext
from steerable.worker.input_buffers import InputBuffers, StepViews
from steerable.worker.sampler import SampleHandle, Sampler
from steerable.worker.warmup import warmup_steps

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


@dataclass
class Launched:
    """A step enqueued on the device, not yet finished."""

    step_id: int
    samples: SampleHandle | None
    captured: list[torch.Tensor]
    copied: torch.cuda.Event | None
    graphed: bool


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.backend = select_backend(config.attention_backend, device)
        cls = model_class(model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = cls(model_config, HookPoints(), self.backend, max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            dummy_weights(self.model, config.seed)
        else:
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
        self.sampler = Sampler()
        self.steering = SteeringTables(model_config.hidden_size, device, dtype)
        self.capture = CaptureBuffers(max_tokens, device)
        self.num_blocks = self._allocate_kv_cache()
        self.graphs = None
        if (device.type == "cuda" and not config.enforce_eager and self.backend is not torch_ref
                and getattr(self.model, "supports_cuda_graphs", True)):
            self.graphs = CudaGraphRunner(config.max_num_seqs)

    # ------------------------------------------------------------ memory

    def _allocate_kv_cache(self) -> int:
        cfg = self.model_config
        layers = len(self.attention_layers)
        kv_dtype = self.config.resolve_kv_dtype(self.dtype)
        bytes_per_block = 2 * layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
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
        self.kv_cache = make(shape, dtype=kv_dtype, device=self.device)
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
        scratch = torch.zeros(1, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=self.config.resolve_kv_dtype(self.dtype), device=self.device)
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = scratch
        torch.cuda.reset_peak_memory_stats(self.device)
        # Sequences of one block each, all reading the scratch block: the activations of a full
        # token budget without needing a real cache.
        bs = self.block_size
        lens = [bs] * (tokens // bs) + ([tokens % bs] if tokens % bs else [])
        seqs = min(self.max_num_seqs, len(lens))
        starts = np.concatenate([[0], np.cumsum(lens)])
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(len(lens), 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), workspace=self.workspace)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, ids, ForwardContext(ids, ids, meta, tokens))
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

    # ------------------------------------------------------------ one step

    @torch.inference_mode()
    def launch(self, step: StepInput) -> Launched:
        """Enqueue the forward, the sampler and the capture copies; nothing waits for the device.
        Sampled tokens stay on the device, kept per request slot for the next step's inputs."""
        if step.steering_update is not None:
            self.steering.apply(step.steering_update)
        ctx, views, key, sample_inside = self._prepare(step)
        program = partial(self._program, ctx, views, sample_inside)
        if key is not None:
            hidden, tokens, staged = self.graphs.run(ctx, key, program)
        else:
            hidden, tokens = program()
            staged = ctx.capture.staged() if ctx.capture is not None else []
        samples = None
        sampling = step.sampling
        if tokens is not None:
            samples = self.sampler.fetch(tokens[:step.num_tokens], sampling.logprobs)
        elif sampling is not None:
            rows = torch.from_numpy(sampling.rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows])
            samples = self.sampler.sample(logits, sampling)
            slots = torch.from_numpy(sampling.slots).to(self.device, non_blocking=True)
            self.buffers.last_sampled.index_copy_(0, slots, samples.tokens)
        captured, copied = self.capture.copy_to_host(staged, step.capture) if staged else ([], None)
        return Launched(step.step_id, samples, captured, copied, key is not None)

    def _program(self, ctx: ForwardContext, views: StepViews, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode CUDA graph holds: the inputs that depend on the device gathered, the
        forward, and, for a step that samples every row with the fused sampler, the logits, the
        samples and each slot's last token. (hidden states, samples or None)."""
        self.buffers.gather(views)
        hidden = self.model(ctx.input_ids, ctx.positions, ctx)
        if not sample:
            return hidden, None
        tokens = fused.gumbel_argmax(self.model.compute_logits(hidden), views.temperature, views.seeds)
        self.buffers.last_sampled.index_copy_(0, views.request_slots, tokens)
        return hidden, tokens

    def finish(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and bring its samples and captured rows to the host."""
        tokens, logprobs = self.sampler.finalize(launched.samples) if launched.samples is not None else ([], [])
        if launched.copied is not None:
            launched.copied.synchronize()
        return StepOutput(launched.step_id, tokens, logprobs, launched.captured, launched.graphed)

    def _samples_inside(self, step: StepInput) -> bool:
        """Whether the step's sampling runs inside its forward program: a decode step that samples
        every row, with the fused sampler (no top-k/top-p/min-p, penalties, held-back tokens or
        logprobs, which take the sampler's other paths)."""
        sampling = step.sampling
        return (sampling is not None and step.max_query_len == 1 and len(sampling.rows) == step.num_tokens
                and fused.enabled(self.buffers.tokens) and not sampling.filtered and not sampling.penalties
                and not sampling.suppress and all(n is None for n in sampling.logprobs))

    def _prepare(self, step: StepInput) -> tuple[ForwardContext, StepViews, tuple | None, bool]:
        """Stage the step's columns in the persistent buffers (padded to a graph size for a decode
        step that can replay one) and build the forward context; the key is None for an eager step."""
        buf = self.buffers
        if step.block_update is not None:
            buf.write_blocks(step.block_update)
        num_tokens = step.num_tokens
        padded, graphed = num_tokens, False
        if self.graphs is not None and step.max_query_len == 1:
            size = self.graphs.padded_size(step.num_requests)
            if size is not None:
                padded, graphed = size, True
        inside = self._samples_inside(step)
        sampling = step.sampling
        views = buf.stage(step, padded, sampling.seeds if inside else None, sampling.temperature if inside else None)
        attn = AttentionMetadata(views.slot_mapping, views.query_start, views.seq_lens, views.block_table,
                                 step.max_query_len, self.workspace)
        ctx = ForwardContext(views.input_ids, views.positions, attn, num_tokens)
        if step.steering is not None:
            ctx.steering = self.steering.step_view(step.steering, views.steer_index)
        if step.capture is not None:
            ctx.capture = self.capture.step_view(step.capture, padded, graphed)
        key = None
        if graphed:
            key = (padded, step.steering.signature if step.steering is not None else None,
                   step.capture.signature if step.capture is not None else None, inside)
        return ctx, views, key, inside

    # ------------------------------------------------------------ lifecycle

    def warmup(self) -> None:
        """Run the start-up steps of ``worker.warmup``: every kernel variant compiled and every decode
        CUDA graph captured now, not in the first requests. Leaves nothing a request can see (K/V
        only in free blocks); the replay counter restarts at zero."""
        sizes = self.graphs.sizes if self.graphs is not None else []
        for step in warmup_steps(self.buffers.tokens.shape[1], self.max_num_seqs, self.max_model_len,
                                 self.block_size, sizes):
            self.finish(self.launch(step))
        if self.graphs is not None:
            self.graphs.num_replays = 0

    def stats(self) -> dict[str, int]:
        graphs = self.graphs
        return {"graph_replays": graphs.num_replays if graphs else 0,
                "graph_captures": graphs.num_captures if graphs else 0,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size() if self.kv_cache is not None
                else 0}

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the graphs so their device memory can be reused."""
        self.graphs = None
        self.model = None
        self.kv_cache = None
        self.attention_layers = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
