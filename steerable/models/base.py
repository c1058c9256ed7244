"""``CausalLM``: what every decoder-only family shares (embedding, the decoder stack, final norm,
LM head, weight loading), so a family file only defines its layer and its config adapter.

Residual adds are deferred into the following norm: a layer receives ``(h, delta)`` (the stream so
far and the last block's output, not yet added) and returns its own. The add happens inside the
next norm's hook-point call, which may fuse it with steering and the norm into one kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import POST_MLP, HookLayout, HookPoints
from steerable.layers.attention import Attention
from steerable.layers.linear import default_weight_loader


class CausalLM(nn.Module):
    # HF checkpoint name parts that load into one shard of a fused parameter: {part: (ours, shard)}.
    stacked_params: dict[str, tuple[str, int]] = {}
    supports_cuda_graphs = True

    def __init__(self, cfg: ModelConfig, hooks: HookPoints, backend: ModuleType, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.hooks = hooks
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        shared = self.make_shared(cfg, max_positions)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, hooks, backend, shared) for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # ------------------------------------------------------------ what a family defines

    def make_shared(self, cfg: ModelConfig, max_positions: int) -> Any:
        """Modules every layer uses (e.g. rotary tables), built once."""
        return None

    def make_layer(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   shared: Any) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def hook_layout(cls, cfg: ModelConfig) -> HookLayout:
        """The residual points of every layer and the per-head attention output."""
        return HookLayout.build(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    # ------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Final-normed hidden states of every row; logits are computed only for sampled rows."""
        h, delta = self.embed(input_ids), None
        for layer in self.layers:
            h, delta = layer(positions, h, delta, ctx)
        return self.hooks.residual_norm([(POST_MLP, len(self.layers) - 1)], h, delta, self.norm, ctx)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype, as HF computes them; the sampler upcasts where it needs to."""
        return F.linear(hidden, self.lm_head.weight)

    # ------------------------------------------------------------ weights

    def map_name(self, name: str) -> str | None:
        """HF name -> our name; None skips tensors we do not keep (rotary caches, a tied lm_head)."""
        if "rotary_emb" in name:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        return name

    def locate(self, name: str) -> tuple[str, int | None]:
        """Our parameter name for a (mapped) checkpoint name, and the shard of it that tensor fills."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.stacked_params:
                fused, shard = self.stacked_params[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def _set_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """A float8 checkpoint's per-tensor KV scale (``layers.N.self_attn.k_scale``): used by that
        layer's attention when the KV cache is float8, ignored otherwise."""
        owner, kind = name.rsplit(".", 1)
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} has no matching attention layer") from None
        attention = next((m for m in module.modules() if isinstance(m, Attention)), None)
        if attention is None or tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r}: expected one scale of an attention layer")
        setattr(attention, kind, float(tensor.float()))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through each parameter's loader; every parameter, and every shard
        of a stacked one, must be filled from the checkpoint."""
        params = dict(self.named_parameters())
        expected = {(name, s) for name, p in params.items() for s in range(getattr(p, "num_shards", 1))}
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            name = self.map_name(hf_name)
            if name is None:
                continue
            if name.endswith((".k_scale", ".v_scale")):
                self._set_kv_scale(name, tensor)
                continue
            target, shard = self.locate(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard)
            except ValueError as err:
                raise ValueError(f"{hf_name}: {err}") from None
            shards = range(getattr(param, "num_shards", 1)) if shard is None else [shard]
            loaded.update((target, s) for s in shards)
        missing = sorted({name for name, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
