"""Checkpoint tensors that are read only when loaded, and only the part a rank keeps.

A parameter's loader narrows the tensor to its shard (``narrow`` composes, as on a torch tensor)
and then ``load``s it: a tensor-parallel rank reads its slice of a safetensors file
(``safe_open(...).get_slice``) or of a GGUF memory map, never the whole tensor. Loaders accept
plain torch tensors too (``materialize`` passes them through).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Box = tuple[tuple[int, int], ...]  # per dimension: [start, stop)


class CheckpointTensor:
    def __init__(self, shape: tuple[int, ...], read: Callable[[Box], torch.Tensor], box: Box | None = None):
        """``read(box)`` returns the tensor's ``box`` in the target dtype."""
        self._read = read
        self._box = box if box is not None else tuple((0, n) for n in shape)
        self.shape = torch.Size(stop - start for start, stop in self._box)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        dim %= len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) of dimension {dim} is outside shape {tuple(self.shape)}")
        lo = self._box[dim][0] + start
        box = self._box[:dim] + ((lo, lo + length),) + self._box[dim + 1:]
        return CheckpointTensor(self.shape, self._read, box)

    def load(self) -> torch.Tensor:
        return self._read(self._box)

    def t(self) -> CheckpointTensor:
        """The transpose of a matrix, still unread: narrowing it narrows the other dimension here
        (GPT-2's ``Conv1D`` weights are stored ``[in, out]``)."""
        if len(self.shape) != 2:
            raise ValueError(f"t() takes a matrix, got shape {tuple(self.shape)}")

        def read(box: Box) -> torch.Tensor:
            (r0, r1), (c0, c1) = box
            return self.narrow(0, c0, c1 - c0).narrow(1, r0, r1 - r0).load().t()
        return CheckpointTensor((self.shape[1], self.shape[0]), read)


def materialize(tensor: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return tensor.load() if isinstance(tensor, CheckpointTensor) else tensor
