"""``Transcoder``: a sparse dictionary that reads the MLP's input and writes the MLP's output, and its
float32 reference math (encode, reconstruct, the error node) that captures and steering are judged by.

One class covers the three shapes the releases ship, all as encoders at consecutive source layers
``layer .. layer + n - 1`` and decoders from each source to a run of output layers starting at it:

- a per-layer transcoder (PLT; Gemma Scope 2, SAELens): one source, decoding to its own layer;
- a set of per-layer transcoders (circuit-tracer's ``transcoder_set``): ``n`` sources, each
  decoding to its own layer only (``W_dec[s]`` of span 1);
- a cross-layer transcoder (CLT; circuit-tracer's ``cross_layer_transcoder``): ``n`` sources,
  source ``s`` decoding to every later layer (``W_dec[s]`` of span ``n - s``).

Feature indices are flat over the sources: feature ``i`` is feature ``i % d_transcoder`` of source
``i // d_transcoder`` (for one source, just ``i``). Activations are those of ``SAE``: ``relu``,
``jumprelu`` (``relu(pre) * (pre > threshold)``) or ``topk`` (``relu(pre)`` but its ``k`` largest zeroed
elsewhere, ties to the lower index), with ``pre = x @ W_enc[s] + b_enc[s]``. The output at layer ``L``
is ``sum_s a_s @ W_dec[s][:, L - layer - s] + b_dec[L] (+ x_L @ W_skip[L])``, ``x_L`` being the input the
transcoder reads at ``L`` (``hook``: the MLP's input, or the residual before the MLP's norm for
circuit-tracer's ``hook_resid_mid`` transcoders).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import MLP_IN, MLP_OUT, POST_ATTN
from steerable.sae.model import checked_activation, checked_weight, keep_top_k, tensors_hash

ARCHITECTURES = ("relu", "jumprelu", "topk")
INPUT_POINTS = (MLP_IN, POST_ATTN)  # where a transcoder may read: the MLP's input, or the residual before its norm


class Transcoder:
    """One source (a per-layer transcoder): ``W_enc [d_in, d_tc]``, ``b_enc [d_tc]``, ``W_dec [d_tc,
    d_out]``, ``b_dec [d_out]``, ``threshold [d_tc]`` (jumprelu), ``W_skip [d_in, d_out]`` (optional:
    the skip term ``x @ W_skip``), at ``layer``.

    ``n`` sources from ``layer`` on (a set of per-layer transcoders, or a cross-layer transcoder):
    ``W_enc [n, d_in, d_tc]``, ``b_enc``/``threshold [n, d_tc]``, ``b_dec [n, d_out]``, ``W_skip [n, d_in,
    d_out]``, and ``W_dec`` a sequence of ``n`` tensors ``[d_tc, span_s, d_out]``: source ``s`` decodes
    to layers ``layer + s .. layer + s + span_s - 1``.

    Tensors are kept in their float dtype (float64 as float32); ``hook`` is where the encoders read
    (``mlp_in``, or ``post_attn`` for a transcoder trained on ``hook_resid_mid``); the decoders write at
    ``mlp_out``."""

    hook_out = MLP_OUT

    def __init__(self, W_enc: Any, b_enc: Any, W_dec: Any, b_dec: Any, architecture: str = "jumprelu",
                 threshold: Any = None, k: int | None = None, W_skip: Any = None, layer: int = 0,
                 hook: str = MLP_IN):
        if architecture not in ARCHITECTURES:
            raise InvalidRequestError(f"architecture: expected one of {list(ARCHITECTURES)}, got {architecture!r}")
        if hook not in INPUT_POINTS:
            raise InvalidRequestError(f"hook: a transcoder reads {list(INPUT_POINTS)}, got {hook!r}")
        if not is_int(layer) or layer < 0:
            raise InvalidRequestError(f"layer: expected a layer index >= 0, got {layer!r}")
        single = getattr(W_enc, "ndim", None) == 2
        W_enc = checked_weight(W_enc, "W_enc", 2 if single else 3)
        if single:
            W_enc = W_enc.unsqueeze(0)
        n, d_in, d_tc = W_enc.shape
        lead = () if single else (n,)
        b_enc = checked_weight(b_enc, "b_enc", 1 if single else 2, (*lead, d_tc)).reshape(n, d_tc)
        if single:
            W_dec = [checked_weight(W_dec, "W_dec", 2).unsqueeze(1)]
        elif isinstance(W_dec, Sequence) and not isinstance(W_dec, (str, bytes)) and len(W_dec) == n:
            W_dec = [checked_weight(w, f"W_dec[{s}]", 3) for s, w in enumerate(W_dec)]
        else:
            raise InvalidRequestError(f"W_dec: expected {n} tensors [d_tc, span, d_out] (one per source layer)")
        d_out = W_dec[0].shape[-1]
        for s, w in enumerate(W_dec):
            if w.shape[0] != d_tc or w.shape[2] != d_out or not 1 <= w.shape[1] <= n - s:
                if single:
                    raise InvalidRequestError(f"W_dec: expected shape [{d_tc}, d_out] (d_tc rows), got "
                                              f"{[w.shape[0], w.shape[2]]}")
                raise InvalidRequestError(f"W_dec[{s}]: expected shape [{d_tc}, span in [1, {n - s}], {d_out}], "
                                          f"got {list(w.shape)}")
        b_dec = checked_weight(b_dec, "b_dec", 1 if single else 2, (*lead, d_out)).reshape(n, d_out)
        threshold = checked_activation(architecture, threshold, k, (*lead, d_tc), "transcoder")
        if threshold is not None:
            threshold = threshold.reshape(n, d_tc)
        if W_skip is not None:
            W_skip = checked_weight(W_skip, "W_skip", 2 if single else 3, (*lead, d_in, d_out)).reshape(n, d_in, d_out)
        self.W_enc, self.b_enc, self.W_dec, self.b_dec = W_enc, b_enc, W_dec, b_dec
        self.threshold, self.W_skip = threshold, W_skip
        self.architecture = architecture
        self.k = k
        self.layer = layer
        self.hook = hook
        self._hash: bytes | None = None

    # ------------------------------------------------------------ shape

    @property
    def n_sources(self) -> int:
        return self.W_enc.shape[0]

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers it reads at, which are also the layers it writes to."""
        return tuple(range(self.layer, self.layer + self.n_sources))

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.b_dec.shape[1]

    @property
    def d_transcoder(self) -> int:
        """Features per source layer."""
        return self.W_enc.shape[2]

    @property
    def d_sae(self) -> int:
        """Features in all (the range of flat feature indices)."""
        return self.n_sources * self.d_transcoder

    @property
    def spans(self) -> tuple[int, ...]:
        """Per source, how many output layers it decodes to."""
        return tuple(w.shape[1] for w in self.W_dec)

    @property
    def kind(self) -> str:
        if self.n_sources == 1:
            return "transcoder"
        return "cross_layer_transcoder" if max(self.spans) > 1 else "transcoder_set"

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        return (f"Transcoder({self.kind}, {self.architecture}, layers={list(self.layers)}, hook={self.hook!r}, "
                f"d_in={self.d_in}, d_transcoder={self.d_transcoder}, skip={self.W_skip is not None}, "
                f"dtype={self.dtype})")

    @classmethod
    def load(cls, path: str, layer: int | None = None) -> "Transcoder":
        """A transcoder from its files: a Gemma Scope 2 directory (``params.safetensors`` +
        ``config.json``), circuit-tracer's per-layer (``config.yaml`` + ``layer_i.safetensors``) or
        cross-layer (``W_enc_i`` / ``W_dec_i``) files, or a SAELens transcoder directory (see
        ``steerable.sae.transcoder_files``). ``layer`` picks one layer of a set of per-layer files."""
        from steerable.sae.transcoder_files import load_transcoder  # files build on this module

        return load_transcoder(path, layer)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Transcoder":
        """A copy with every weight on ``device`` in ``dtype`` (None: unchanged); self when nothing changes."""
        device = self.device if device is None else torch.device(device)
        dtype = self.dtype if dtype is None else dtype
        tensors = self._tensors()
        if device == self.device and all(t.dtype == dtype for t in tensors.values()):
            return self
        out = object.__new__(Transcoder)
        out.__dict__.update(self.__dict__)
        for name, tensor in tensors.items():
            if name.startswith("W_dec."):
                continue
            setattr(out, name, tensor.to(device, dtype))
        out.W_dec = [w.to(device, dtype) for w in self.W_dec]
        out._hash = None
        return out

    # ------------------------------------------------------------ features by flat index

    def locate(self, index: int) -> tuple[int, int]:
        """(source layer, index within that layer's features) of flat feature ``index``."""
        source, feature = divmod(index, self.d_transcoder)
        return self.layer + source, feature

    def decoder_rows(self, index: int) -> list[tuple[int, torch.Tensor]]:
        """Where feature ``index`` writes: ``(layer, W_dec row)`` at each layer it decodes to,
        float32 CPU vectors."""
        layer, feature = self.locate(index)
        block = self.W_dec[layer - self.layer][feature]  # [span, d_out]
        return [(layer + t, block[t].to("cpu", torch.float32)) for t in range(block.shape[0])]

    def decodes_across(self, stages: Sequence[tuple[int, int]] | None) -> bool:
        """Whether a decoder reaches from a layer of one pipeline stage (``[start, end)`` ranges) into
        another's: a clamp's read and writes, or an error node's terms, would then be on different ranks."""
        if not stages or len(stages) == 1:
            return False
        stage_of = {layer: i for i, (start, end) in enumerate(stages) for layer in range(start, end)}
        return any(stage_of.get(self.layer + s) != stage_of.get(self.layer + s + span - 1)
                   for s, span in enumerate(self.spans))

    def feature_read(self, index: int) -> tuple[torch.Tensor, float, float]:
        """How a row reads feature ``index`` at its source layer: ``(e, bias, threshold)`` with ``a =
        p if p > threshold else 0`` for ``p = x·e + bias`` (``SAE.feature_read``'s convention)."""
        layer, feature = self.locate(index)
        source = layer - self.layer
        e = self.W_enc[source, :, feature].to("cpu", torch.float32).contiguous()
        bias = float(self.b_enc[source, feature].float())
        threshold = max(float(self.threshold[source, feature].float()), 0.0) if self.architecture == "jumprelu" \
            else 0.0
        return e, bias, threshold

    # ------------------------------------------------------------ the reference math (float32)

    def encode(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Activations ``[..., d_transcoder]`` in float32 of the encoder at ``layer`` (default: the
        only one) on its input ``x``."""
        source = self._source(layer)
        x = torch.as_tensor(x).to(self.device, torch.float32)
        if x.shape[-1] != self.d_in:
            raise InvalidRequestError(f"x: expected a last dimension of {self.d_in} (d_in), got shape {tuple(x.shape)}")
        pre = x @ self.W_enc[source].float() + self.b_enc[source].float()
        acts = pre.relu()
        if self.architecture == "jumprelu":
            return acts * (pre > self.threshold[source].float())
        return keep_top_k(acts, self.k) if self.architecture == "topk" and self.k < self.d_transcoder else acts

    def reconstruct(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The output at each of its layers, float32 ``[..., d_out]``, from the input it reads at each
        (``inputs[s]`` at layer ``layer + s``): decoders, bias and skip term."""
        if len(inputs) != self.n_sources:
            raise InvalidRequestError(f"inputs: expected {self.n_sources} tensors (one per layer), got {len(inputs)}")
        xs = [torch.as_tensor(x).to(self.device, torch.float32) for x in inputs]
        out = [self.b_dec[s].float().expand(*xs[s].shape[:-1], self.d_out).clone() for s in range(self.n_sources)]
        for s, x in enumerate(xs):
            acts = self.encode(x, self.layer + s)
            for t in range(self.W_dec[s].shape[1]):
                out[s + t] += acts @ self.W_dec[s][:, t].float()
            if self.W_skip is not None:
                out[s] += x @ self.W_skip[s].float()
        return out

    def error(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The error node at each layer: the MLP's output minus ``reconstruct(inputs)``."""
        return [torch.as_tensor(y).to(self.device, torch.float32) - r
                for y, r in zip(outputs, self.reconstruct(inputs), strict=True)]

    def _source(self, layer: int | None) -> int:
        if layer is None:
            if self.n_sources != 1:
                raise InvalidRequestError(f"layer: this transcoder reads at layers {list(self.layers)}; say which")
            return 0
        if layer not in self.layers:
            raise InvalidRequestError(f"layer: {layer!r} is not one of this transcoder's layers {list(self.layers)}")
        return layer - self.layer

    # ------------------------------------------------------------ identity

    @property
    def content_hash(self) -> bytes:
        """Hash of the weights and settings (computed once), as ``SAE.content_hash``."""
        if self._hash is None:
            self._hash = tensors_hash(["transcoder", self.architecture, self.k, self.layer, self.hook, self.spans,
                                       str(self.dtype)], self._tensors())
        return self._hash

    def describe(self) -> dict[str, Any]:
        """What ``LLM.list_saes`` reports for it."""
        return {"layer": self.layer, "hook": self.hook, "d_sae": self.d_sae, "architecture": self.architecture,
                "kind": self.kind, "layers": list(self.layers), "hook_out": self.hook_out,
                "d_transcoder": self.d_transcoder, "skip": self.W_skip is not None}

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {name: getattr(self, name) for name in ("W_enc", "b_enc", "b_dec", "threshold", "W_skip")
                   if getattr(self, name) is not None}
        tensors.update({f"W_dec.{s}": w for s, w in enumerate(self.W_dec)})
        return tensors
