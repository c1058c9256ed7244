"""``CausalLM``: what every decoder-only family shares (embedding, the decoder stack, final norm,
LM head, weight loading), so a family file only defines its layer and its config adapter.

Residual adds are deferred into the following norm: a layer receives ``(h, delta)`` (the stream so
far and the last block's output, not yet added) and returns its own. The add happens inside the
next norm's hook-point call, which may fuse it with steering and the norm into one kernel.

Under pipeline parallelism a stage builds only its layers (the others are ``OtherStage``
placeholders, so parameter names keep their global layer index), the embedding on the first
stage, the final norm and head on the last. A stage that is not the last hands on ``(h, delta)``
as they are: the deferred add of its last layer's output (that layer's ``post_mlp``) happens on the
next stage, inside its first norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig
from steerable.distributed.groups import current_placement
from steerable.hook_points import ATTENTION_HEADS, POST_MLP, HookLayout, HookPoints, unpack_delta
from steerable.layers.attention import Attention
from steerable.layers.checkpoint import materialize
from steerable.layers.linear import Weight, default_weight_loader
from steerable.layers.vocab import LMHead, VocabEmbedding


class OtherStage(nn.Module):
    """A decoder layer that another pipeline stage holds."""


class CausalLM(nn.Module):
    # HF checkpoint name parts that load into one shard of a fused parameter: {part: (ours, shard)}.
    stacked_params: dict[str, tuple[str, int]] = {}
    supports_cuda_graphs = True
    # Capture components whose value on a tensor-parallel rank is that rank's slice of the row
    # (per-head attention outputs: heads are split over the ranks); the others are replicated.
    tp_sharded_components = frozenset({ATTENTION_HEADS})

    def __init__(self, cfg: ModelConfig, hooks: HookPoints, backend: ModuleType, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.hooks = hooks
        self.placement = placement = current_placement(cfg.num_layers)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if placement.is_first_stage else None
        shared = self.make_shared(cfg, max_positions)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, hooks, backend, shared) if placement.owns_layer(i)
                                    else OtherStage() for i in range(cfg.num_layers))
        self.stage_layers = list(self.layers[placement.layers[0]:placement.layers[1]])
        self.norm = self.lm_head = None
        if placement.is_last_stage:
            self.norm = self.make_norm(cfg)
            tied = self.embed_tokens if cfg.tie_word_embeddings else None
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied)

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
        """The residual points of every layer, the per-head attention output and patterns."""
        return HookLayout.build(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim,
                                windows=[cfg.attention_window(layer) for layer in range(cfg.num_layers)])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the token embedding, plus the position embedding in families
        that learn one (GPT-2)."""
        return self.embed(input_ids)

    # ------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Final-normed hidden states of every row on the last stage (logits are computed only for
        sampled rows); on an earlier stage, ``(h, delta)`` stacked for the next stage, which
        receives them as ``ctx.pipeline_in``; with ``ctx.stop_at_layer`` (one stage only), the
        stream entering that layer, the layers above it left out."""
        if self.embed_tokens is not None:
            h, delta = self.embed_at(input_ids, positions), None
        else:
            h, delta = ctx.pipeline_in[0], ctx.pipeline_in[1]
        stop = ctx.stop_at_layer  # a step whose rows are wanted only up to that layer (single stage)
        for layer in self.stage_layers if stop is None else self.stage_layers[:stop]:
            h, delta = layer(positions, h, delta, ctx)
        delta, delta_norm = unpack_delta(delta)
        if stop is not None or self.norm is None:
            delta = delta if delta_norm is None else delta_norm(delta)
            if stop is not None:
                return self.hooks.stream_entering(stop, self.cfg.num_layers, h, delta, ctx)
            return torch.stack((h, delta))
        return self.hooks.residual_norm([(POST_MLP, self.cfg.num_layers - 1)], h, delta, self.norm, ctx,
                                        delta_norm=delta_norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model dtype, as HF computes them (the sampler upcasts where it needs to),
        on tensor-parallel rank 0 of the last stage; None on the other ranks of that stage."""
        return self.lm_head(hidden)

    def logits_for_sampler(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, float | None]:
        """(logits, the soft-cap the fused sampler applies to them in registers, or None): where a
        model's last logit op can run inside the sampler, it is left out here (Gemma's final cap)."""
        return self.compute_logits(hidden), None

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

    def on_stage(self, name: str) -> str | None:
        """The parameter name this stage loads a (mapped) checkpoint name into; None when the
        tensor belongs to another stage. A tied head on a last stage without the embedding loads
        the embedding's tensor itself."""
        placement = self.placement
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            return name if placement.owns_layer(int(parts[1])) else None
        if parts[0] == "embed_tokens" and self.embed_tokens is None:
            tied_here = self.lm_head is not None and self.cfg.tie_word_embeddings
            return ".".join(["lm_head", *parts[1:]]) if tied_here else None
        if parts[0] in ("norm", "lm_head") and self.norm is None:
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

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Load HF-named tensors through each parameter's loader; every parameter, and every shard
        of a stacked one, must be filled from the checkpoint."""
        params = dict(self.named_parameters())
        expected = {(name, s) for name, p in params.items() for s in range(getattr(p, "num_shards", 1))}
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            name = self.map_name(hf_name)
            if name is not None:
                name = self.on_stage(name)
            if name is None:
                continue
            if name.endswith((".k_scale", ".v_scale")):
                self._set_kv_scale(name, materialize(tensor))
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
