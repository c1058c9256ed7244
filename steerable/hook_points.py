"""The named points where the forward pass hands activations to steering and capture.

Model files call ``hooks.residual_norm(...)`` / ``hooks.observe(...)`` and declare a
``HookLayout`` (which components they offer at which layers, and their widths). What happens at a
point is decided per step by the forward context's views: ``ctx.steering`` writes (additive rows,
projection clamps), then ``ctx.capture`` reads, so captured activations are the steered ones.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from steerable.errors import InvalidRequestError

if TYPE_CHECKING:  # annotations only: the CLI offers the point names before it imports torch
    import torch
    from torch import nn

PRE_ATTN = "pre_attn"  # residual stream entering layer L (HF hidden_states[L])
POST_ATTN = "post_attn"  # residual after the attention residual add
POST_MLP = "post_mlp"  # layer output (HF hidden_states[L + 1], before any final norm)
RESIDUAL_POINTS = (PRE_ATTN, POST_ATTN, POST_MLP)
# The MLP's own points, where transcoders read and write (TransformerLens: blocks.L.ln2.hook_normalized,
# blocks.L.hook_mlp_out).
MLP_IN = "mlp_in"  # the MLP's input, after its norm
MLP_OUT = "mlp_out"  # what the MLP block adds to the residual (after a post-MLP norm; MoE: the experts' sum)
MLP_POINTS = (MLP_IN, MLP_OUT)
HOOK_POINTS = RESIDUAL_POINTS + MLP_POINTS  # the hidden-size points steering writes and capture reads
# TransformerLens' names of the same points (SAELens names its activation columns and SAEs by them).
_TRANSFORMER_LENS = {PRE_ATTN: "hook_resid_pre", POST_ATTN: "hook_resid_mid", POST_MLP: "hook_resid_post",
                     MLP_IN: "ln2.hook_normalized", MLP_OUT: "hook_mlp_out"}
_FROM_TRANSFORMER_LENS = {name: point for point, name in _TRANSFORMER_LENS.items()}
_TL_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")

HIDDEN_STATES = "hidden_states"  # the capture component read at a residual point
ATTENTION_HEADS = "attention_heads"  # per-head attention output before o_proj, concatenated
ROUTER_LOGITS = "router_logits"  # MoE gate logits before top-k
ATTENTION_PATTERNS = "attention_patterns"  # per-head attention probabilities of selected query rows
COMPONENTS = (HIDDEN_STATES, ATTENTION_HEADS, ROUTER_LOGITS, ATTENTION_PATTERNS)
# A transcoder's reconstruction error at mlp_out (its "error node"), from what it reads and the
# MLP's output (``capture.gather``); a capture group of this name spans both points.
TRANSCODER_ERROR = "transcoder_error"

Site = tuple[str, int]


@dataclass(frozen=True)
class PostNormed:
    """A layer's branch output that its post-norm has not normalised yet: ``norm(value)`` is what
    the residual stream adds. A layer hands this on (instead of the normed tensor) only where no
    hook point reads or writes the normed value, so the next add + norm kernel can apply the
    post-norm too (one kernel a layer fewer; Gemma's sandwich norms)."""

    value: "torch.Tensor"
    norm: "nn.Module"


def unpack_delta(delta: "torch.Tensor | PostNormed | None") -> "tuple[torch.Tensor | None, nn.Module | None]":
    """(the branch output, the post-norm still to apply or None) of what a layer handed on."""
    return (delta.value, delta.norm) if isinstance(delta, PostNormed) else (delta, None)


def transformer_lens_name(layer: int, hook: str) -> str:
    """TransformerLens' name of a point at layer L: ``blocks.L.hook_resid_pre|mid|post`` for
    ``pre_attn|post_attn|post_mlp``, ``blocks.L.ln2.hook_normalized`` / ``blocks.L.hook_mlp_out`` for
    ``mlp_in`` / ``mlp_out``."""
    return f"blocks.{layer}.{_TRANSFORMER_LENS[hook]}"


def layers_needed(layers: Sequence[int], hook: str) -> int:
    """How many leading layers a forward must run to reach ``hook`` at every one of ``layers``
    (TransformerLens' ``stop_at_layer``): the stream entering a layer (``pre_attn``) needs only the
    layers below it; a point inside or after a layer needs that layer too."""
    return max(layer + (hook != PRE_ATTN) for layer in layers)


def check_residual_point(hook: Any, where: str) -> str:
    """``hook`` if it names a residual point, else ``InvalidRequestError`` naming ``where``."""
    if hook not in RESIDUAL_POINTS:
        raise InvalidRequestError(f"{where}: unknown hook {hook!r}; expected one of {list(RESIDUAL_POINTS)}")
    return hook


def check_hook_point(hook: Any, where: str) -> str:
    """``hook`` if it names a point steering writes and capture reads (a residual point, ``mlp_in``
    or ``mlp_out``), else ``InvalidRequestError`` naming ``where``."""
    if hook not in HOOK_POINTS:
        raise InvalidRequestError(f"{where}: unknown hook {hook!r}; expected one of {list(HOOK_POINTS)}")
    return hook


def transformer_lens_site(name: Any) -> Site | None:
    """(point, layer) of a TransformerLens hook name (``blocks.3.hook_resid_post`` -> ``("post_mlp",
    3)``), the inverse of ``transformer_lens_name``; None for any other name."""
    match = _TL_NAME.match(name) if isinstance(name, str) else None
    point = _FROM_TRANSFORMER_LENS.get(match.group(2)) if match else None
    return None if point is None else (point, int(match.group(1)))


@dataclass(frozen=True)
class ComponentLayout:
    """Where a model offers one capture component and what a row of it looks like."""

    layers: tuple[int, ...]
    width: int
    shape: dict[str, int] = field(default_factory=dict)  # e.g. num_heads/head_size, num_experts
    per_layer: dict[int, dict[str, Any]] = field(default_factory=dict)  # e.g. a layer's sliding window

    def describe(self) -> dict[int, dict[str, Any]]:
        """Per layer, the layout reported with captured rows."""
        return {layer: {**self.shape, **self.per_layer.get(layer, {}), "width": self.width} for layer in self.layers}


@dataclass(frozen=True)
class HookLayout:
    """What a model offers the planes: steerable residual points at every layer and the capture
    components it places. Known from the config alone, so a driver that holds no weights knows it."""

    num_layers: int
    hidden_size: int
    components: dict[str, ComponentLayout]

    @classmethod
    def build(cls, num_layers: int, hidden_size: int, num_heads: int, head_dim: int,
              router_layers: Sequence[int] = (), num_experts: int = 0,
              windows: Sequence[int | None] = ()) -> "HookLayout":
        """``windows``: each layer's sliding window (None: full attention), which bounds the keys
        of its attention patterns; a pattern row's width is its head count times its key length."""
        layers = tuple(range(num_layers))
        windows = list(windows) or [None] * num_layers
        components = {
            HIDDEN_STATES: ComponentLayout(layers, hidden_size),
            ATTENTION_HEADS: ComponentLayout(layers, num_heads * head_dim,
                                             {"num_heads": num_heads, "head_size": head_dim}),
            ATTENTION_PATTERNS: ComponentLayout(layers, num_heads, {"num_heads": num_heads},
                                                {layer: {"sliding_window": windows[layer]} for layer in layers}),
        }
        if router_layers:
            components[ROUTER_LOGITS] = ComponentLayout(tuple(router_layers), num_experts,
                                                        {"num_experts": num_experts})
        return cls(num_layers, hidden_size, components)


@dataclass(frozen=True)
class SiteWrite:
    """Every steering write at one site in a step, as table lookups by each token's row ``index``:
    ``h += add[index]``, then for each clamp slot k (float32 math)
    ``p = h·d; h += strength * (clip(factor * p, lo, hi) - p) * d`` with ``d = clamp_dir[index, k]``
    and ``(lo, hi, strength, factor) = clamp_bounds[index, k]``. Where a feature clamp acts, ``clamp_write``
    and ``clamp_gate`` are set too: the read becomes ``p = h·d + bias``, gated to ``p if p >
    threshold else 0`` (``(bias, threshold) = clamp_gate[index, k]``), and the write goes along
    ``clamp_write[index, k]`` instead of ``d``. Row 0 of every table changes nothing."""

    index: torch.Tensor  # int64 [>= T]
    add: torch.Tensor | None = None  # [rows, H]
    clamp_dir: torch.Tensor | None = None  # [rows, slots, H] read directions
    clamp_bounds: torch.Tensor | None = None  # float32 [rows, slots, 4]
    clamp_write: torch.Tensor | None = None  # [rows, slots, H] write directions
    clamp_gate: torch.Tensor | None = None  # float32 [rows, slots, 2]


class SteeringView(Protocol):
    def acts_at(self, site: Site) -> bool: ...

    def site_write(self, site: Site) -> SiteWrite | None:
        """The writes at a site where ``acts_at`` holds (what a fused kernel applies); None where
        they do not fit one (low-rank edits, gates), and the site runs on its own."""

    def apply(self, site: Site, hidden: torch.Tensor) -> torch.Tensor: ...

    def reads_at(self, site: Site) -> bool:
        """Whether writes elsewhere (transcoder feature clamps) read the value at ``site``."""

    def read(self, site: Site, hidden: torch.Tensor) -> None: ...


class CaptureView(Protocol):
    def wants(self, site: Site) -> bool: ...

    def record(self, site: Site, value: torch.Tensor) -> None: ...

    def record_patterns(self, site: Site, q: torch.Tensor, attn: nn.Module, meta: Any) -> None: ...


class HookPoints:
    """Dispatches each hook point to the step's steering and capture views (``ctx.steering``,
    ``ctx.capture``; None when a plane has nothing to do this step)."""

    def residual(self, point: str, layer: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        site = (point, layer)
        steering = ctx.steering
        if steering is not None:
            if steering.acts_at(site):
                hidden = steering.apply(site, hidden)
            if steering.reads_at(site):
                steering.read(site, hidden)
        if ctx.capture is not None:
            ctx.capture.record(site, hidden)
        return hidden

    def residual_norm(self, sites: Sequence[Site], residual: torch.Tensor, delta: torch.Tensor | None,
                      norm: nn.Module, ctx: Any, delta_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``residual + delta`` passes the hook points ``sites`` in order and is
        then normalised by ``norm``: returns (the residual, its norm). ``delta_norm``: the branch
        output ``delta`` is normalised by it first (a post-norm no hook point sees).

        When no read needs a value that a later write changes, the norm may do all of it, the
        steering writes (adds and clamps) included, in one kernel (``norm.fused_add_norm``);
        otherwise each point is applied in turn. Both give the same values."""
        writes = self._fusable_writes(sites, ctx)
        if writes is not None:
            fused = norm.fused_add_norm(residual, delta, writes, delta_norm)
            if fused is not None:
                hidden, normed = fused
                for site in sites:  # no write follows a read here (``_fusable_writes``)
                    if ctx.steering is not None and ctx.steering.reads_at(site):
                        ctx.steering.read(site, hidden)
                    if ctx.capture is not None:
                        ctx.capture.record(site, hidden)
                return hidden, normed
        if delta_norm is not None and delta is not None:
            delta = delta_norm(delta)
        hidden = residual if delta is None else residual + delta
        for point, layer in sites:
            hidden = self.residual(point, layer, hidden, ctx)
        return hidden, norm(hidden)

    def stream_entering(self, layer: int, num_layers: int, residual: torch.Tensor, delta: torch.Tensor | None,
                        ctx: Any) -> torch.Tensor:
        """The residual stream ``residual + delta`` entering ``layer`` (leaving the model when it is
        ``num_layers``) through the hook points there, for a forward that stops before ``layer``:
        the same points, in the same order, as that layer's first norm passes it."""
        hidden = residual if delta is None else residual + delta
        sites = [(POST_MLP, layer - 1)] * (layer > 0) + [(PRE_ATTN, layer)] * (layer < num_layers)
        for point, at in sites:
            hidden = self.residual(point, at, hidden, ctx)
        return hidden

    def mlp_in(self, layer: int, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The MLP's input after its norm (``blocks.L.ln2.hook_normalized``): steering writes, then
        reads (transcoder feature clamps, capture); the MLP runs on what this returns."""
        return self.residual(MLP_IN, layer, x, ctx)

    def mlp_out(self, layer: int, out: torch.Tensor, ctx: Any) -> torch.Tensor:
        """What the MLP block adds to the residual (``blocks.L.hook_mlp_out``): steering writes (a
        transcoder feature clamp's among them), then capture reads (a transcoder's error node
        among them); the residual stream adds what this returns."""
        return self.residual(MLP_OUT, layer, out, ctx)

    @staticmethod
    def in_use(site: Site, ctx: Any) -> bool:
        """Whether steering writes or capture reads at ``site`` this step: where neither does, a
        model need not form the value there (GPT-NeoX's parallel ``post_attn``)."""
        return ((ctx.steering is not None and (ctx.steering.acts_at(site) or ctx.steering.reads_at(site)))
                or (ctx.capture is not None and ctx.capture.wants(site)))

    def steered(self, component: str, layer: int, value: torch.Tensor, ctx: Any) -> torch.Tensor:
        """A component steering may write (MoE router logits: ``RouterBias``) and capture then reads."""
        return self.residual(component, layer, value, ctx)

    def observe(self, component: str, layer: int, value: torch.Tensor, ctx: Any) -> None:
        if ctx.capture is not None:
            ctx.capture.record((component, layer), value)

    def attention_patterns(self, layer: int, q: torch.Tensor, attn: nn.Module, ctx: Any) -> None:
        """After ``attn`` (a paged ``Attention``) has written this step's K/V: the probabilities of
        the rows a capture selects are computed from ``q`` and the cache, only when some are."""
        site = (ATTENTION_PATTERNS, layer)
        if ctx.capture is not None and ctx.capture.wants(site):
            ctx.capture.record_patterns(site, q, attn, ctx.attn)

    @staticmethod
    def _fusable_writes(sites: Sequence[Site], ctx: Any) -> list[SiteWrite] | None:
        """The writes at ``sites`` in order, or None when they cannot run inside the norm (a read
        between two writes, or more than two sites that write)."""
        steering, capture = ctx.steering, ctx.capture
        writes = []
        read = False
        for site in sites:
            if steering is not None and steering.acts_at(site):
                write = None if read else steering.site_write(site)
                if write is None:  # a read between two writes, or writes beyond adds and clamps
                    return None
                writes.append(write)
            read = read or (capture is not None and capture.wants(site)) or (steering is not None
                                                                              and steering.reads_at(site))
        return writes if len(writes) <= 2 else None
