"""The driver's named SAEs and transcoders: what ``LLM.register_sae`` adds, what feature steering
resolves names against at admission, and what the capture plane ships to the workers.

Each SAE is kept in the model dtype (steering rows and captured features are computed from the
same rounded weights on every path) on the host: the driver holds no device, and reading a row
of a device copy would wait for the step in flight. Whether a name may go is decided by its users
(``LLMEngine.unregister_sae`` asks the planes); this registry only checks what an SAE must fit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from steerable.errors import InvalidRequestError
from steerable.sae.model import SAE
from steerable.sae.transcoder import Transcoder


class SaeRegistry:
    def __init__(self, hidden_size: int, num_layers: int, dtype: torch.dtype,
                 pipeline_stages: Sequence[tuple[int, int]] | None = None):
        """``pipeline_stages``: each pipeline stage's ``[start, end)`` layers (None: one stage)."""
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.pipeline_stages = pipeline_stages
        self._saes: dict[str, SAE] = {}

    def register(self, name: str, sae: SAE | Transcoder) -> SAE | Transcoder:
        """Checks ``sae`` (an SAE or a transcoder) against the model and keeps a model-dtype host
        copy; returns it."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"name: SAE names must be non-empty strings, got {name!r}")
        if name in self._saes:
            raise InvalidRequestError(f"name: an SAE named {name!r} is registered already; unregister it first")
        if not isinstance(sae, (SAE, Transcoder)):
            raise InvalidRequestError(f"sae: expected a steerable.SAE or steerable.Transcoder, got {type(sae).__name__}")
        if sae.d_in != self.hidden_size:
            raise InvalidRequestError(f"sae.d_in: {sae.d_in} does not match the model's hidden size {self.hidden_size}")
        if isinstance(sae, Transcoder):
            self._check_transcoder(sae)
        if sae.layer >= self.num_layers:
            raise InvalidRequestError(f"sae.layer: {sae.layer} is not a layer index in [0, {self.num_layers})")
        stored = sae.to("cpu", self.dtype)
        self._saes[name] = stored
        return stored

    def _check_transcoder(self, transcoder: Transcoder) -> None:
        """A transcoder's layers must all be the model's and its output the hidden size."""
        last = transcoder.layers[-1]
        if last >= self.num_layers:
            raise InvalidRequestError(f"transcoder.layers: {list(transcoder.layers)} reach layer {last}; the model "
                                      f"has layers [0, {self.num_layers})")
        if transcoder.d_out != self.hidden_size:
            raise InvalidRequestError(f"transcoder.d_out: {transcoder.d_out} does not match the model's hidden size "
                                      f"{self.hidden_size}")

    def remove(self, name: str) -> None:
        self.get(name, "name")
        del self._saes[name]

    def get(self, name: Any, where: str = "sae") -> SAE | Transcoder:
        """The SAE registered as ``name``, or ``InvalidRequestError`` naming ``where``."""
        sae = self._saes.get(name) if isinstance(name, str) else None
        if sae is None:
            raise InvalidRequestError(f"{where}: unknown SAE {name!r}; registered: {sorted(self._saes)}")
        return sae

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: sae.describe() for name, sae in self._saes.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._saes

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._saes))

    def __len__(self) -> int:
        return len(self._saes)

    def items(self) -> list[tuple[str, SAE]]:
        return list(self._saes.items())
