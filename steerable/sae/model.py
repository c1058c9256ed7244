"""``SAE``: a sparse autoencoder attached at one residual point of the model, its validated weights
and the float32 reference math (encode, decode) that captures and feature clamps are judged by.

Architectures: ``relu`` / ``standard`` (``a = relu(pre)``), ``jumprelu`` (``a = pre * (pre >
threshold)``, relu'd) and ``topk`` (``relu(pre)`` with all but the ``k`` largest zeroed, ties to
the lower index), where ``pre = (x - b_dec if apply_b_dec_to_input else x) @ W_enc + b_enc``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP, check_hook_point

ARCHITECTURES = ("relu", "standard", "jumprelu", "topk")


class SAE:
    """Weights ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_in]``, ``b_dec [d_in]``
    (tensors or arrays; kept in their float dtype, float64 as float32), read at ``hook`` of
    ``layer``. ``rescale_acts_by_decoder_norm`` (SAELens topk) multiplies ``pre`` by each decoder
    row's norm and divides activations by it when decoding: it is folded into the weights here
    (``W_enc``/``b_enc`` times the norm, unit ``W_dec`` rows), which computes the same activations
    and reconstructions, so ``W_dec[i]`` is the unit direction feature ``i`` writes."""

    def __init__(self, W_enc: Any, b_enc: Any, W_dec: Any, b_dec: Any, architecture: str = "jumprelu",
                 threshold: Any = None, k: int | None = None, apply_b_dec_to_input: bool = False,
                 layer: int = 12, hook: str = POST_MLP, rescale_acts_by_decoder_norm: bool = False):
        if architecture not in ARCHITECTURES:
            raise InvalidRequestError(f"architecture: expected one of {list(ARCHITECTURES)}, got {architecture!r}")
        W_enc = checked_weight(W_enc, "W_enc", 2)
        d_in, d_sae = W_enc.shape
        W_dec = checked_weight(W_dec, "W_dec", 2, (d_sae, d_in))
        b_enc = checked_weight(b_enc, "b_enc", 1, (d_sae,))
        b_dec = checked_weight(b_dec, "b_dec", 1, (d_in,))
        threshold = checked_activation(architecture, threshold, k, (d_sae,), "SAE")
        if not isinstance(apply_b_dec_to_input, bool):
            raise InvalidRequestError(f"apply_b_dec_to_input: expected a bool, got {apply_b_dec_to_input!r}")
        if not isinstance(rescale_acts_by_decoder_norm, bool):
            raise InvalidRequestError(f"rescale_acts_by_decoder_norm: expected a bool, got "
                                      f"{rescale_acts_by_decoder_norm!r}")
        if rescale_acts_by_decoder_norm and architecture != "topk":
            raise InvalidRequestError("rescale_acts_by_decoder_norm: only topk SAEs take it")
        if not is_int(layer) or layer < 0:
            raise InvalidRequestError(f"layer: expected a layer index >= 0, got {layer!r}")
        check_hook_point(hook, "hook")
        if rescale_acts_by_decoder_norm:
            norms = W_dec.float().norm(dim=1).clamp_min(1e-8)
            W_enc = (W_enc.float() * norms).to(W_enc.dtype)
            b_enc = (b_enc.float() * norms).to(b_enc.dtype)
            W_dec = (W_dec.float() / norms[:, None]).to(W_dec.dtype)
        self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold = W_enc, b_enc, W_dec, b_dec, threshold
        self.architecture = architecture
        self.k = k
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.layer = layer
        self.hook = hook
        self._hash: bytes | None = None

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        return (f"SAE({self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}, layer={self.layer}, "
                f"hook={self.hook!r}, dtype={self.dtype})")

    @classmethod
    def load(cls, path: str, layer: int | None = None, hook: str | None = None) -> "SAE":
        """An SAE from its files: a SAELens directory, an EleutherAI sparsify directory or a Gemma
        Scope ``params.npz`` (see ``steerable.sae.files``)."""
        from steerable.sae.files import load_sae  # files build on this module

        return load_sae(path, layer, hook)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "SAE":
        """A copy with every weight on ``device`` in ``dtype`` (None: unchanged); self when nothing changes."""
        device = self.device if device is None else torch.device(device)
        dtype = self.dtype if dtype is None else dtype
        if device == self.device and dtype == self.dtype and all(t.dtype == dtype for t in self._tensors().values()):
            return self
        out = object.__new__(SAE)
        out.__dict__.update(self.__dict__)
        for name, tensor in self._tensors().items():
            setattr(out, name, tensor.to(device, dtype))
        out._hash = None
        return out

    # ------------------------------------------------------------ the reference math (float32)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``pre = x_in @ W_enc + b_enc`` in float32, ``x_in = x - b_dec`` when the SAE says so."""
        x = torch.as_tensor(x).to(self.device, torch.float32)
        if x.shape[-1] != self.d_in:
            raise InvalidRequestError(f"x: expected a last dimension of {self.d_in} (d_in), got shape {tuple(x.shape)}")
        if self.apply_b_dec_to_input:
            x = x - self.b_dec.float()
        return x @ self.W_enc.float() + self.b_enc.float()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``a`` [..., d_sae] in float32 (the module docstring's formulas)."""
        pre = self.pre_activations(x)
        if self.architecture == "jumprelu":
            return (pre * (pre > self.threshold.float())).relu()
        acts = pre.relu()
        return keep_top_k(acts, self.k) if self.architecture == "topk" and self.k < self.d_sae else acts

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """``f @ W_dec + b_dec`` [..., d_in] in float32."""
        f = torch.as_tensor(f).to(self.device, torch.float32)
        if f.shape[-1] != self.d_sae:
            raise InvalidRequestError(f"f: expected a last dimension of {self.d_sae} (d_sae), got shape {tuple(f.shape)}")
        return f @ self.W_dec.float() + self.b_dec.float()

    # ------------------------------------------------------------ one feature, for steering

    def decoder_row(self, index: int) -> torch.Tensor:
        """``W_dec[index]`` as a float32 CPU vector: the direction feature ``index`` writes."""
        return self.W_dec[index].to("cpu", torch.float32)

    def feature_read(self, index: int) -> tuple[torch.Tensor, float, float]:
        """How a row reads feature ``index``: ``(e, bias, threshold)`` with ``a = p if p > threshold
        else 0`` for ``p = h·e + bias``. ``e = W_enc[:, index]``; ``bias = b_enc[index]``, less
        ``b_dec·e`` when ``b_dec`` is subtracted from the input; ``threshold`` is 0 for relu and
        topk (a topk feature's activation is its relu'd pre-activation: whether it is among the
        row's top ``k`` is not asked) and ``max(threshold[index], 0)`` for jumprelu."""
        e = self.W_enc[:, index].to("cpu", torch.float32)
        bias = float(self.b_enc[index].float())
        if self.apply_b_dec_to_input:
            bias -= float(self.b_dec.to("cpu", torch.float32) @ e)
        threshold = max(float(self.threshold[index].float()), 0.0) if self.architecture == "jumprelu" else 0.0
        return e.contiguous(), bias, threshold

    @property
    def content_hash(self) -> bytes:
        """Hash of the weights and settings (computed once): equal SAEs steer alike, so prefix-cache
        keys and steering identities name an SAE by it, never by its registered name."""
        if self._hash is None:
            self._hash = tensors_hash([self.architecture, self.k, self.apply_b_dec_to_input, self.layer, self.hook,
                                       str(self.dtype)], self._tensors())
        return self._hash

    def describe(self) -> dict[str, Any]:
        """What ``LLM.list_saes`` reports for it."""
        return {"layer": self.layer, "hook": self.hook, "d_sae": self.d_sae, "architecture": self.architecture}

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def checked_activation(architecture: str, threshold: Any, k: Any, shape: tuple[int, ...], kind: str) -> torch.Tensor | None:
    """The threshold of a ``kind`` (an SAE, a transcoder) of ``architecture``, checked: jumprelu
    needs one per feature (``shape``), topk an integer ``k`` in ``[1, width]``, others neither."""
    if architecture == "jumprelu":
        if threshold is None:
            raise InvalidRequestError(f"threshold: a jumprelu {kind} needs one value per feature")
        threshold = checked_weight(threshold, "threshold", len(shape), shape)
    elif threshold is not None:
        raise InvalidRequestError(f"threshold: only jumprelu {kind}s take one, not {architecture!r}")
    if architecture == "topk":
        if not is_int(k) or not 1 <= k <= shape[-1]:
            raise InvalidRequestError(f"k: a topk {kind} needs an integer in [1, {shape[-1]}], got {k!r}")
    elif k is not None:
        raise InvalidRequestError(f"k: only topk {kind}s take one, not {architecture!r}")
    return threshold


def keep_top_k(acts: torch.Tensor, k: int) -> torch.Tensor:
    """``acts`` with all but each row's ``k`` largest zeroed; a stable descending sort ranks equal
    values by index, so ties go to the lower one."""
    order = torch.sort(acts, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(acts).scatter(-1, order, acts.gather(-1, order))


def tensors_hash(settings: list[Any], tensors: dict[str, torch.Tensor]) -> bytes:
    """A content hash of a dictionary's settings (JSON-able) and named tensors."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(settings).encode())
    for name, tensor in tensors.items():
        digest.update(name.encode())
        digest.update(_bytes(tensor))
    return digest.digest()


def checked_weight(value: Any, name: str, ndim: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A float tensor of the expected rank and shape with finite values, or an error naming it."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise InvalidRequestError(f"{name}: expected floating-point values, got dtype {value.dtype}")
        value = torch.from_numpy(np.array(value, dtype=np.float32 if value.dtype == np.float64 else value.dtype))
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"{name}: expected a tensor or an array, got {type(value).__name__}")
    if not value.is_floating_point():
        raise InvalidRequestError(f"{name}: expected floating-point values, got dtype {value.dtype}")
    value = value.detach()
    if value.dtype == torch.float64:
        value = value.float()
    if value.ndim != ndim or (shape is not None and tuple(value.shape) != shape):
        expected = list(shape) if shape is not None else f"{ndim} dimensions"
        raise InvalidRequestError(f"{name}: expected shape {expected}, got {list(value.shape)}")
    if 0 in value.shape:
        raise InvalidRequestError(f"{name}: must not be empty, got shape {list(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise InvalidRequestError(f"{name}: contains NaN or Inf")
    return value.contiguous()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor (a view of a CPU copy; bfloat16 has no numpy dtype)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()

