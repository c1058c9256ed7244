"""Owns the model, its KV cache and the per-step device inputs; runs one forward + sample per step."""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch

from steerable.config import EngineConfig, ModelConfig
from steerable.engine.request import Request
from steerable.engine.scheduler import SchedulerOutput
from steerable.hook_points import HookPoints
from steerable.layers.attention import Attention
from steerable.layers.attention_backends import torch_ref
from steerable.models.loader import ModelSource, iter_weights
from steerable.models.registry import model_class
from steerable.worker.batch import AttentionMetadata, StepBatch, build_host_columns
from steerable.worker.sampler import Sampler

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU when kv_cache_tokens is not given


def select_backend(name: str, device: torch.device) -> ModuleType:
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return torch_ref
    if name in ("auto", "triton"):
        from steerable.layers.attention_backends import triton_paged
        return triton_paged
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
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
        self.num_blocks = self._allocate_kv_cache()
        self.sampler = Sampler(device, config.seed)

    def _allocate_kv_cache(self) -> int:
        cfg = self.model_config
        layers = len(self.attention_layers)
        bytes_per_block = 2 * layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        if self.config.kv_cache_tokens is not None:
            num_blocks = self.config.kv_cache_tokens // self.block_size
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            num_blocks = int((total * self.config.gpu_memory_utilization - used) // bytes_per_block)
        else:
            num_blocks = _CPU_KV_BYTES // bytes_per_block
        if num_blocks < 1:
            raise ValueError("not enough memory for a single KV block; lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_tokens")
        shape = (2, layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * bytes_per_block / 2**20)
        return num_blocks

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        cols = build_host_columns(sched.scheduled, self.block_size)

        def dev(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(array).to(device=self.device, dtype=dtype, non_blocking=True)

        attn = AttentionMetadata(
            slot_mapping=dev(cols["slot_mapping"]),
            query_start_loc=dev(cols["query_start"], torch.int32),
            seq_lens=dev(cols["seq_lens"], torch.int32),
            block_table=dev(cols["block_table"], torch.int32),
            max_query_len=cols["max_query_len"],
        )
        return StepBatch(
            input_ids=dev(cols["token_ids"]), positions=dev(cols["positions"]), token_req=dev(cols["token_req"]),
            attn=attn, sample_rows=dev(cols["sample_rows"]), scheduled=sched.scheduled,
            num_tokens=len(cols["token_ids"]), host_positions=cols["positions"], host_token_ids=cols["token_ids"],
            host_token_req=cols["token_req"], host_query_start=cols["query_start"],
        )

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (float32) of the rows that sample this step."""
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def execute(self, batch: StepBatch) -> tuple[list[int], list[dict | None]]:
        logits = self.forward(batch)
        sampling = [s.request for s in batch.scheduled if s.samples]
        if not sampling:
            return [], []
        return self.sampler(logits, sampling)

    def add_request(self, request: Request) -> None:
        self.sampler.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.sampler.remove_request(request.request_id)
