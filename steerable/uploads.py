"""Host-to-device copies of a step's small inputs that never wait for the device.

A copy from pageable host memory first waits for the stream to drain, so the host would sit idle
until the step in flight ends instead of preparing the next one. Going through page-locked memory
(PyTorch's caching host allocator, which reuses a block only once its copy has finished) keeps the
copy asynchronous; on a CPU device the array is used as it is.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``, copied without a stream sync on CUDA."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
