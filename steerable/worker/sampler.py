"""Turn the logits of the sampled rows into next tokens (and logprobs when asked).

Sampling is the exponential race (argmax of p / E with E ~ Exp(1), equivalently argmax of
logits / T + Gumbel noise), which equals drawing from p. A row's noise depends only on its key
(the request's seed mixed with the position sampled), not on what else is in the batch: on the CPU
it comes from a generator seeded with the key, on the GPU from a Philox stream keyed by it inside
one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steerable.layers import cpu_kernels, fused, logit_kernels
from steerable.step import PenaltyInput, SamplingInput
from steerable.structured.bitmask import apply_bitmask
from steerable.worker.penalties import apply_penalties

_MIX_A, _MIX_B, _MASK = 6364136223846793005, 1442695040888963407, (1 << 63) - 1


@dataclass
class SampleHandle:
    """Samples of a launched step: device tokens, their pinned host copy and the event to wait on."""

    tokens: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None
    raw_logprobs: torch.Tensor | None
    logprobs: list[tuple[int, list[int]] | None]  # per row: (top-N, extra token ids) or None


class Sampler:
    """Stateless: a row's noise is drawn from its own ``seeds`` entry (a function of the request's
    seed and the position being sampled), so every rank that samples the same logits draws the same
    tokens, and a request's samples do not depend on the rest of the batch."""

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingInput) -> SampleHandle:
        """Enqueue sampling of logits [S, V] (any float dtype); nothing here waits for the device.
        ``finalize`` brings the tokens (and logprobs) to the host."""
        for row, token_ids in sampling.suppress.items():  # stop tokens held back until min_tokens
            logits[row, torch.from_numpy(token_ids).to(logits.device)] = float("-inf")
        if sampling.grammar_rows is not None:  # structured outputs; before the logprobs, as vLLM masks them
            apply_bitmask(logits, sampling.grammar_rows, sampling.grammar_bitmask)
        want = sampling.logprobs
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(n is not None for n in want) else None
        if sampling.logit_bias or sampling.allowed:  # after the logprobs, which are the model's own
            _bias(logits, sampling)
        if sampling.penalties:
            logits = _penalised(logits, sampling.penalties)
        temperature = torch.from_numpy(sampling.temperature)
        seeds = torch.from_numpy(sampling.seeds)
        if fused.enabled(logits) and not sampling.filtered:
            tokens = logit_kernels.gumbel_argmax(logits, temperature.to(logits.device, non_blocking=True),
                                         seeds.to(logits.device, non_blocking=True))  # reads the logits' own dtype
        else:
            tokens = _sample_torch(logits.float(), sampling)
        return self.fetch(tokens, want, raw_logprobs)

    @staticmethod
    def fetch(tokens: torch.Tensor, want: list[int | None], raw_logprobs: torch.Tensor | None = None) -> SampleHandle:
        """Enqueue the copy of sampled tokens (drawn here or inside a forward program) to the host."""
        host = tokens.to("cpu", non_blocking=True) if tokens.is_cuda else tokens
        done = torch.cuda.Event() if tokens.is_cuda else None
        if done is not None:
            done.record()
        return SampleHandle(tokens, host, done, raw_logprobs, want)

    @staticmethod
    def finalize(handle: SampleHandle) -> tuple[list[int], list[dict | None]]:
        if handle.done is not None:
            handle.done.synchronize()
        token_list = handle.host.tolist()
        logprobs: list[dict | None] = [None] * len(token_list)
        if handle.raw_logprobs is not None:
            for i, asked in enumerate(handle.logprobs):
                if asked is not None:
                    logprobs[i] = requested_logprobs(handle.raw_logprobs[i], token_list[i], *asked)
        return token_list, logprobs


def noise_seed(seed: int, position: int) -> int:
    """The noise key of the token sampled at ``position`` (what ``SamplingInput.seeds`` holds)."""
    return (seed * _MIX_A + position * _MIX_B) & _MASK


def _bias(logits: torch.Tensor, sampling: SamplingInput) -> None:
    """OpenAI's ``logit_bias`` added to its rows; rows with ``allowed_token_ids`` keep only those."""
    device = logits.device
    for row, (ids, values) in sampling.logit_bias.items():
        logits[row, torch.from_numpy(ids).to(device)] += torch.from_numpy(values).to(device, logits.dtype)
    for row, ids in sampling.allowed.items():
        keep = torch.from_numpy(ids).to(device)
        kept = logits[row, keep].clone()
        logits[row] = float("-inf")
        logits[row, keep] = kept


def _penalised(logits: torch.Tensor, penalties: list[PenaltyInput]) -> torch.Tensor:
    """A float32 copy with each listed row's penalties applied."""
    logits = logits.float()
    rows = [p.row for p in penalties]
    penalised = logits[rows]
    apply_penalties(penalised, [p.prompt_ids for p in penalties], [p.output_ids for p in penalties],
                    [p.repetition for p in penalties], [p.frequency for p in penalties],
                    [p.presence for p in penalties])
    logits[rows] = penalised
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (argmax's answer): on a CPU the vectorised kernel (64 rows of 49k
    logits: ~0.4 against 2.7 ms), elsewhere ``max``'s indices (on a CPU 3x faster than argmax)."""
    if cpu_kernels.applies(logits) and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        return cpu_kernels.kernels().argmax_rows(logits)
    return logits.max(dim=-1).indices


def _sample_torch(logits: torch.Tensor, sampling: SamplingInput) -> torch.Tensor:
    """Greedy rows take the argmax; the others top-k/top-p/min-p filter, then the exponential race
    with noise from a generator seeded by the row's key."""
    tokens = greedy_tokens(logits)
    sampled = np.flatnonzero(sampling.temperature > 0)
    if len(sampled):
        rows = torch.from_numpy(sampled).to(logits.device)
        tokens[rows] = _race(logits[rows], sampling, sampled)
    return tokens


def _race(logits: torch.Tensor, sampling: SamplingInput, rows: np.ndarray) -> torch.Tensor:
    device = logits.device
    temperature = torch.from_numpy(sampling.temperature[rows]).to(device)
    logits = logits / temperature[:, None]
    top_k = sampling.top_k[rows]
    if top_k.any():
        k = torch.from_numpy(np.where(top_k > 0, np.minimum(top_k, logits.shape[-1]), logits.shape[-1])).to(device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = sampling.top_p[rows]
    if (top_p < 1.0).any():
        p = torch.from_numpy(top_p).to(device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p[:, None]
        probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
    min_p = sampling.min_p[rows]
    if min_p.any():
        threshold = torch.from_numpy(min_p).to(device)[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs)
    for i, seed in enumerate(sampling.seeds[rows].tolist()):
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def requested_logprobs(logprobs: torch.Tensor, token: int, num: int,
                       token_ids: list[int]) -> dict[int, tuple[float, int]]:
    """``{token id: (logprob, rank)}`` for one sampled row (vLLM semantics): the sampled token, the
    ``num`` most likely tokens (``-1``: every vocabulary entry) and every id in ``token_ids``. A
    rank is 1 + the number of tokens strictly more likely."""
    if num == -1:
        ascending = logprobs.sort().values
        ranks = logprobs.numel() - torch.searchsorted(ascending, logprobs, right=True) + 1
        return dict(zip(range(logprobs.numel()), zip(logprobs.tolist(), ranks.tolist())))
    ids = [token, *token_ids]
    values = logprobs[ids]
    ranks = (logprobs[None, :] > values[:, None]).sum(dim=1) + 1
    result = {t: (v, r) for t, v, r in zip(ids, values.tolist(), ranks.tolist())}
    if num:
        values, ids = logprobs.topk(num)
        for r, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            result.setdefault(t, (v, r))
    return result
