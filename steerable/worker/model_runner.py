"""The worker: owns the model, its KV cache, the persistent per-step device inputs, the device
halves of the steering and capture planes, and the sampler. Each step it takes one plain
``StepInput``, runs one forward (eager or a CUDA-graph replay) and samples; ``finish`` hands back
a plain ``StepOutput``.

One runner per rank: under tensor/pipeline parallelism (``distributed``) every rank runs this same
code on the same step input, holding its shard of the model and the layers of its stage. A stage
after the first receives the residual stream before its forward and one before the last sends it
on after; only tensor-parallel rank 0 of the last stage samples.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import numpy as np
import torch

from steerable.capture.gather import CaptureBuffers
from steerable.config import EngineConfig, ModelConfig
from steerable.distributed.groups import ParallelContext, building
from steerable.hook_points import ATTENTION_PATTERNS, HookPoints
from steerable.kv_groups import KVGroups
from steerable.layers import fused, logit_kernels
from steerable.layers.attention import Attention, key_cache_view, value_cache_view
from steerable.layers.attention_backends import torch_ref
from steerable.models.loader import ModelSource, dummy_weights, iter_weights
from steerable.models.registry import model_class
from steerable.sae.worker_tables import SaeTables
from steerable.steering.tables import SteeringTables
from steerable.step import SamplingInput, StepInput, StepOutput, to_device
from steerable.worker.cuda_graphs import CudaGraphRunner
from steerable.worker.forward_context import AttentionMetadata, ForwardContext
from steerable.worker.input_buffers import InputBuffers, StepViews
from steerable.worker.prompt_logprobs import prompt_logprobs, to_host
from steerable.worker.sampler import SampleHandle, Sampler
from steerable.worker.warmup import compile_steps, graph_steps, synthetic_step

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU when kv_cache_tokens is not given
_GRAPH_RESERVE_BYTES = 1 << 30  # kept free for CUDA-graph pools and sampler temporaries
# Mixed steps up to this many tokens replay graphs: beyond it their kernels outlast their launches.
_MAX_MIXED_GRAPH_TOKENS = 2048


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
    prompt_logprobs: list[list[torch.Tensor]] | None = None
    placeholders: int = 0  # a step stopped below the last layer: tokens it reports without sampling


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 parallel: ParallelContext | None = None):
        """``parallel``: this rank's place and groups (None: the whole model on one rank)."""
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.parallel = parallel if parallel is not None else ParallelContext.single(model_config.num_layers)
        placement = self.parallel.placement
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.backend = select_backend(config.attention_backend, device)
        cls = model_class(model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), building(self.parallel):
                self.model = cls(model_config, HookPoints(), self.backend, max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            dummy_weights(self.model, config.seed)
        else:
            self.model.load_weights(iter_weights(source, model_config.num_heads, model_config.num_kv_heads, dtype))
        self.model.eval().requires_grad_(False)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_groups = KVGroups.for_model(model_config)
        self.kv_slots, self.kv_placement = self.kv_groups.stage_placement(range(*placement.layers))
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = InputBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, device,
                                    self.kv_groups.num_groups, steps_in_flight=max(1, placement.pp_size - 1))
        # The residual stream from the previous stage lands here: (h, delta) of up to max_tokens rows.
        self.pipeline_in = None if placement.is_first_stage else torch.zeros(
            2 * max_tokens, model_config.hidden_size, dtype=dtype, device=device)
        # Under tensor parallelism the sampled tokens, which feed the next step, go to every rank.
        self.share_samples = self.parallel.tp.size > 1 and placement.pp_size == 1
        self.single_rank = self.parallel.tp.size == 1 and placement.pp_size == 1
        self.single_stage = placement.pp_size == 1  # where a forward may stop below the last layer
        self.kv_dtype = config.resolve_kv_dtype(dtype)
        self.workspace = None
        self.shared_attention = None  # the shared-prefix decode op, where the backend has one
        if self.backend is not torch_ref:
            # One row more than the engine runs: a mixed step replaying a graph has a padding sequence.
            self.workspace = self.backend.DecodeWorkspace(config.max_num_seqs + 1, self.attention_layers[0].num_heads,
                                                          model_config.head_dim, device)
            from steerable.layers.attention_backends import shared_prefix
            self.shared_attention = shared_prefix
        self.num_shared_prefix_steps = 0
        self.sampler = Sampler()
        self.steering = SteeringTables(model_config.hidden_size, device, dtype, owns=placement.owns,
                                       max_tokens=self.buffers.tokens.shape[1], max_seqs=config.max_num_seqs)
        self.saes = SaeTables(device, dtype, owns=placement.owns)
        self.capture = CaptureBuffers(max_tokens, device, self.parallel.tp, self.model.tp_sharded_components,
                                      [model_config.attention_window(layer) for layer in range(model_config.num_layers)],
                                      self.saes)
        self.host_block_lifetime = self.capture.host_block_lifetime
        self.parallel.tp.warm_up(device)
        self.num_blocks = self.parallel.agree_min(self._kv_cache_blocks())  # every rank holds the same blocks
        self._allocate_kv_cache(self.num_blocks)
        self.graphs = None
        if (device.type == "cuda" and not config.enforce_eager and self.backend is not torch_ref
                and getattr(self.model, "supports_cuda_graphs", True)):
            self.graphs = CudaGraphRunner(config.max_num_seqs, min(_MAX_MIXED_GRAPH_TOKENS, max_tokens))

    # ------------------------------------------------------------ memory

    def _kv_cache_blocks(self) -> int:
        """How many KV blocks this rank can hold: a block is ``block_size`` tokens of this rank's
        layers of one KV group (``kv_slots`` layers at most) and of its KV heads."""
        if self.config.kv_cache_tokens is not None:  # as much memory as that many tokens of every layer
            return self.config.kv_cache_tokens // self.block_size * len(self.attention_layers) // self.kv_slots
        if self.device.type == "cuda":
            return int(self._profile_free_bytes() // self._bytes_per_block)
        return _CPU_KV_BYTES // self._bytes_per_block

    @property
    def _bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        return 2 * self.kv_slots * self.block_size * layer.num_kv_heads * layer.head_dim * self.kv_dtype.itemsize

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """One pool of blocks; every layer reads the blocks of its KV group at its slot."""
        kv_dtype = self.kv_dtype
        if num_blocks < 1:
            raise ValueError("not enough memory for a single KV block; lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_tokens")
        layer = self.attention_layers[0]
        block = (self.block_size, layer.num_kv_heads, layer.head_dim)
        # Zeroed: attention over a position-major V reads whole blocks, slots never written
        # included, and weights those it skips 0, which needs them finite.
        self.kv_cache = torch.zeros((2, self.kv_slots, num_blocks * math.prod(block)), dtype=kv_dtype,
                                    device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.kv_group, slot = self.kv_placement[i]
            layer.k_cache = key_cache_view(self.kv_cache[0, slot], num_blocks, *block)
            layer.v_cache = value_cache_view(self.kv_cache[1, slot], num_blocks, *block)
        logger.info("KV cache: %d blocks of %d tokens x %d layers in %d groups (%.1f GiB)", num_blocks,
                    self.block_size, self.kv_slots, self.kv_groups.num_groups,
                    num_blocks * self._bytes_per_block / 2**30)

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run the largest step the scheduler can produce (with a scratch KV block) and the sampler
        on the most rows, then give the KV cache what ``gpu_memory_utilization`` leaves."""
        cfg = self.model_config
        tokens = max(self.config.max_num_batched_tokens, self.max_num_seqs)
        layer = self.attention_layers[0]
        scratch = torch.zeros(1, self.block_size, layer.num_kv_heads, layer.head_dim, dtype=self.kv_dtype,
                              device=self.device)
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = scratch
        torch.cuda.reset_peak_memory_stats(self.device)
        # Sequences of one block each, all reading the scratch block: the activations of a full
        # token budget without needing a real cache.
        bs = self.block_size
        lens = [bs] * (tokens // bs) + ([tokens % bs] if tokens % bs else [])
        seqs = min(self.max_num_seqs, len(lens))
        starts = np.concatenate([[0], np.cumsum(lens)])
        groups = self.kv_groups.num_groups
        meta = AttentionMetadata(
            slot_mapping=torch.full((groups, tokens), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(groups, len(lens), 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), workspace=self.workspace)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        ctx = ForwardContext(ids, ids, meta, tokens)
        if self.pipeline_in is not None:  # a later stage: what the previous one would send
            ctx.pipeline_in = self.pipeline_in[:2 * tokens].view(2, tokens, cfg.hidden_size)
        hidden = self.model(ids, ids, ctx)
        if self.parallel.placement.is_last_stage:
            logits = self.model.compute_logits(hidden[:seqs])
            if logits is not None:  # the sampling rank; the torch sampler path works in float32
                probs = logits.float().softmax(-1)
                torch.empty_like(probs).exponential_()
                del logits, probs
        del hidden
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
        if step.sae_update is not None:
            self.saes.apply(step.sae_update)
        ctx, views, key, inside = self._prepare(step)
        if ctx.pipeline_in is not None:  # the previous stage's residual stream, into the buffer the forward reads
            self.parallel.pipe.receive(ctx.pipeline_in)
            if ctx.steering is not None and ctx.steering.gated:  # with each token's steering row after its gates
                self.parallel.pipe.receive(ctx.steering.receive_index())
        program = partial(self._program, ctx, views, inside)
        if key is not None:
            hidden, tokens, staged = self.graphs.run(ctx, key, program)
        else:
            hidden, tokens = program()
            staged = ctx.capture.staged() if ctx.capture is not None else []
        samples = plp = None
        if ctx.stop_at_layer is not None:  # nothing above the layer was computed: nothing to sample
            captured, copied = self.capture.copy_to_host(staged, step.capture) if staged else ([], None)
            rows = len(step.sampling.rows) if step.sampling is not None else 0
            return Launched(step.step_id, None, captured, copied, False, placeholders=rows)
        if step.prompt_logprobs and self.parallel.placement.is_last_stage:
            plp = prompt_logprobs(hidden, step.prompt_logprobs, self.model.compute_logits)
        if not self.parallel.placement.is_last_stage:
            self.parallel.pipe.send(hidden)
            if ctx.steering is not None and ctx.steering.gated:
                self.parallel.pipe.send(ctx.steering.index_out())
        elif tokens is not None:
            samples = self.sampler.fetch(tokens[:step.num_tokens], step.sampling.logprobs)
        elif step.sampling is not None:
            samples = self._sample(hidden, step.sampling)
        captured, copied = self.capture.copy_to_host(staged, step.capture) if staged else ([], None)
        return Launched(step.step_id, samples, captured, copied, key is not None, plp)

    def _program(self, ctx: ForwardContext, views: StepViews, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode CUDA graph holds: the inputs that depend on the device gathered, the
        forward, and, for a step that samples every row with the fused sampler, the logits, the
        samples and each slot's last token. (hidden states, samples or None)."""
        self.buffers.gather(views)
        hidden = self.model(ctx.input_ids, ctx.positions, ctx)
        if not sample:
            return hidden, None
        logits, softcap = self.model.logits_for_sampler(hidden)
        tokens = logit_kernels.gumbel_argmax(logits, views.temperature, views.seeds, softcap)
        self.buffers.last_sampled.index_copy_(0, views.request_slots, tokens)
        return hidden, tokens

    def _sample(self, hidden: torch.Tensor, sampling: SamplingInput) -> SampleHandle | None:
        """Sample on the rank that has the logits; keep the tokens per request slot for the next
        step's placeholders (on every tensor-parallel rank: each embeds them)."""
        rows = to_device(sampling.rows, self.device)
        logits = self.model.compute_logits(hidden[rows])
        samples = self.sampler.sample(logits, sampling) if logits is not None else None
        if samples is None and not self.share_samples:
            return None
        tokens = samples.tokens if samples is not None else torch.empty(len(sampling.rows), dtype=torch.int64,
                                                                         device=self.device)
        if self.share_samples:
            self.parallel.tp.broadcast(tokens)
        slots = to_device(sampling.slots, self.device)
        self.buffers.last_sampled.index_copy_(0, slots, tokens)
        return samples

    def finish(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and bring its samples and captured rows to the host."""
        tokens, logprobs = self.sampler.finalize(launched.samples) if launched.samples is not None else ([], [])
        if launched.placeholders:  # discarded by the requests of a stopped step (token 0 of the vocabulary)
            tokens, logprobs = [0] * launched.placeholders, [None] * launched.placeholders
        if launched.copied is not None:
            launched.copied.synchronize()
        return StepOutput(launched.step_id, tokens, logprobs, launched.captured, launched.graphed,
                          to_host(launched.prompt_logprobs))

    def _samples_inside(self, step: StepInput) -> bool:
        """Whether the step's sampling runs inside its forward program: a decode step that samples
        every row, with the fused sampler (no top-k/top-p/min-p, penalties, held-back tokens, logit
        biases, allowed token ids, grammar masks, logprobs or prompt logprobs, which take the
        sampler's other paths: the forward still replays its graph, and the logits it returns are
        masked and sampled after it), on an engine of
        one rank (tensor-parallel ranks gather their logits and share the samples; only a pipeline's last stage samples)."""
        sampling = step.sampling
        return (sampling is not None and self.single_rank and step.max_query_len == 1 and step.stop_at_layer is None
                and len(sampling.rows) == step.num_tokens and fused.enabled(self.buffers.tokens)
                and not sampling.filtered and not sampling.penalties and not sampling.suppress
                and not sampling.logit_bias and not sampling.allowed and sampling.grammar_rows is None
                and not step.prompt_logprobs and all(n is None for n in sampling.logprobs))

    def _shares_prefix(self, step: StepInput, num_seqs: int, query_len_hint: int) -> bool:
        """Whether the step's attention runs the shared-prefix kernels: a step whose decode rows
        have a shared group, on a backend that has them, at a shape where they reproduce the
        unshared kernel (``attention_backends.shared_prefix.shares``)."""
        return (step.shared_prefix is not None and self.shared_attention is not None
                and self.shared_attention.shares(num_seqs, self.attention_layers[0].num_kv_heads, query_len_hint,
                                                 self.workspace))

    def _graph_shape(self, step: StepInput) -> tuple[int, int, bool] | None:
        """(padded tokens, padded sequences, mixed) of the graph the step can replay, or None: a
        decode step pads its sequences to the decode ladder; a mixed step pads its tokens to the
        mixed ladder and its sequences to one more than the engine runs. Capture rows ride along
        (their indices are buffers, the plan's shape is in the key), except attention patterns."""
        if self.graphs is None or _captures_patterns(step) or self._stops(step):
            return None
        if step.max_query_len == 1:
            size = self.graphs.padded_size(step.num_requests)
            return None if size is None else (size, size, False)
        size = self.graphs.mixed_padded_size(step.num_tokens)
        if size is None:
            return None
        return size, self.graphs.mixed_seqs, True

    def _prepare(self, step: StepInput) -> tuple[ForwardContext, StepViews, tuple | None, bool]:
        """Stage the step's columns in the persistent buffers (padded to a graph's shape for a step
        that can replay one) and build the forward context; the key is None for an eager step."""
        buf = self.buffers
        if step.block_update is not None:
            buf.write_blocks(step.block_update)
        num_tokens = step.num_tokens
        shape = self._graph_shape(step)
        padded, pad_seqs, mixed = shape if shape is not None else (num_tokens, step.num_requests, False)
        inside = self._samples_inside(step)
        sampling = step.sampling
        views = buf.stage(step, padded, pad_seqs, sampling.seeds if inside else None,
                          sampling.temperature if inside else None)
        # A mixed graph serves any query lengths: its attention tiles follow the padded size.
        query_len_hint = padded if mixed else step.max_query_len
        # The reference backend plans each step's decode reads afresh (torch_ref.StepPlans).
        workspace = torch_ref.StepPlans() if self.backend is torch_ref else self.workspace
        attn = AttentionMetadata(views.slot_mapping, views.query_start, views.seq_lens, views.block_table,
                                 query_len_hint, workspace)
        shared = self._shares_prefix(step, pad_seqs, query_len_hint)
        if shared:
            attn.prefix_lens, attn.shared_group = views.prefix_lens, step.shared_prefix.group
            attn.shared_attention = self.shared_attention.shared_prefix_attention
            self.num_shared_prefix_steps += 1
        ctx = ForwardContext(views.input_ids, views.positions, attn, num_tokens,
                             stop_at_layer=step.stop_at_layer if self._stops(step) else None)
        if self.pipeline_in is not None:
            ctx.pipeline_in = self.pipeline_in[:2 * padded].view(2, padded, self.model_config.hidden_size)
        if step.steering is not None:
            ctx.steering = self.steering.step_view(step.steering, views.steer_index, views)
        if step.capture is not None:
            ctx.capture = self.capture.step_view(step.capture, padded, shape is not None, step)
        key = None
        if shape is not None:
            key = (padded, step.steering.signature if step.steering is not None else None,
                   step.capture.signature if step.capture is not None else None, inside, shared, mixed)
        return ctx, views, key, inside

    def _stops(self, step: StepInput) -> bool:
        """Whether the step's forward stops below the last layer: asked for, on one pipeline
        stage (a pipeline runs every stage; the requests discard their tokens all the same)."""
        return step.stop_at_layer is not None and self.single_stage

    # ------------------------------------------------------------ lifecycle

    def warmup(self, shared_group: int | None = None) -> None:
        """Run the start-up steps of ``worker.warmup``: every kernel variant compiled (eagerly) and
        every decode and mixed CUDA graph captured now, not in the first requests; with
        ``shared_group`` (the KV group the step builder finds shared prefixes in) the graphs of
        steps that share one too. Leaves nothing a request can see (K/V only in free blocks); the
        replay and shared-step counters restart at zero. On a CPU, a step of two sequences: oneDNN's
        packed copy of every weight (``gemv.packed_cpu_linear``, which takes two rows and more) is made
        then, not in the first request."""
        if self.device.type == "cpu":
            self.finish(self.launch(synthetic_step(min(2, self.max_num_seqs), 1, self.block_size)))
            return
        graphs, self.graphs = self.graphs, None
        try:
            for step in compile_steps(self.buffers.tokens.shape[1], self.max_num_seqs, self.max_model_len,
                                      self.block_size):
                self.finish(self.launch(step))
        finally:
            self.graphs = graphs
        if graphs is None:
            return
        shared = shared_group if self.shared_attention is not None else None
        for step in graph_steps(graphs.sizes, graphs.mixed_sizes, self.max_num_seqs, self.max_model_len,
                                self.block_size, shared):
            self.finish(self.launch(step))
        graphs.num_replays = self.num_shared_prefix_steps = 0

    def stats(self) -> dict[str, int]:
        graphs = self.graphs
        return {"graph_replays": graphs.num_replays if graphs else 0,
                "graph_captures": graphs.num_captures if graphs else 0,
                "shared_prefix_steps": self.num_shared_prefix_steps,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size() if self.kv_cache is not None
                else 0}

    def shutdown(self) -> None:
        """Drop the model, the KV cache and the graphs so their device memory can be reused."""
        if self.parallel.pipe is not None:
            self.parallel.pipe.flush()
        self.graphs = None
        self.model = None
        self.kv_cache = None
        self.attention_layers = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _captures_patterns(step: StepInput) -> bool:
    """A step with attention-pattern rows runs eagerly: their padded width changes every step."""
    return step.capture is not None and any(g.hook == ATTENTION_PATTERNS for g in step.capture.groups)
