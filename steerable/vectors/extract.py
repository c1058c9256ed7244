"""From paired activations to one direction: the four estimators ``train`` offers.

Inputs are ``pos`` and ``neg``, float arrays [pairs, width] where row i of each is one contrast
pair. Every estimator returns a direction whose sign makes positives project higher than their
negatives on average (mean over pairs of ``(pos - neg) · v`` > 0), computed in float64.

- ``mean_diff``: the mean of ``pos - neg`` (not normalised unless asked).
- ``pca_diff``: the first right singular vector of the uncentred difference matrix ``pos - neg``
  (what steering-vectors gets by mirroring each difference to ±d).
- ``pca_center``: repeng's: each pair centred on its own mean, i.e. rows ``±(pos - neg) / 2``,
  then the first principal direction. Those rows have mean zero and the same scatter matrix as the
  differences, so it equals ``pca_diff`` up to rounding; it is kept under repeng's name.
- ``logistic``: the weight vector of an L2-regularised logistic-regression probe telling positives
  from negatives (features centred and scaled by one scalar to unit size per feature, as sklearn's
  default ``C=1`` expects, so the weights stay in activation space).
"""

from __future__ import annotations

import numpy as np
import torch

from steerable.errors import InvalidRequestError

METHODS = ("mean_diff", "pca_diff", "pca_center", "logistic")


def direction(method: str, pos: np.ndarray, neg: np.ndarray, normalize: bool | None = None) -> np.ndarray:
    """One float32 direction. ``normalize``: None is the method's default (``mean_diff`` raw, the
    others unit length), True a unit vector, False the unit direction times the mean pair
    difference's component along it (``mean_diff`` stays raw), so every method has a natural size."""
    if method not in METHODS:
        raise InvalidRequestError(f"method: unknown method {method!r}; expected one of {list(METHODS)}")
    pos = np.asarray(pos, dtype=np.float64)
    neg = np.asarray(neg, dtype=np.float64)
    diff = pos - neg
    if method == "mean_diff":
        v = diff.mean(axis=0)
    elif method == "pca_diff":
        v = _first_component(diff)
    elif method == "pca_center":
        center = (pos + neg) / 2
        v = _first_component(np.concatenate([pos - center, neg - center]))
    else:
        v = _logistic_weights(pos, neg)
    if (diff @ v).mean() < 0:
        v = -v
    norm = np.linalg.norm(v)
    if normalize is None:
        normalize = method != "mean_diff"
    if normalize and norm > 0:
        v = v / norm
    elif not normalize and method != "mean_diff" and norm > 0:
        unit = v / norm
        v = unit * (diff @ unit).mean()
    return v.astype(np.float32)


def _first_component(rows: np.ndarray) -> np.ndarray:
    """The first right singular vector of ``rows`` (uncentred PCA)."""
    _, _, vt = np.linalg.svd(rows, full_matrices=False)
    return vt[0]


def _logistic_weights(pos: np.ndarray, neg: np.ndarray, c: float = 1.0) -> np.ndarray:
    """Weights of ``min mean log-loss + |w|^2 / (2 C n)`` (sklearn's ``C`` convention), by L-BFGS."""
    x = np.concatenate([pos, neg])
    x = x - x.mean(axis=0)
    x = x * (np.sqrt(x.shape[1]) / max(float(np.linalg.norm(x, axis=1).mean()), 1e-12))  # features ~ unit scale
    features = torch.from_numpy(x)
    labels = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))]).double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")
    penalty = 1.0 / (2.0 * c * len(x))

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(features @ w + b, labels) + penalty * (w @ w)
        value.backward()
        return value

    optimizer.step(loss)
    return w.detach().numpy()
