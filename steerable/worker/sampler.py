"""Turn the logits of the sampled rows into next tokens (and logprobs when asked).

Sampling is the exponential race (argmax of p / E with E ~ Exp(1), equivalently argmax of
logits / T + Gumbel noise), which equals drawing from p. A request's noise depends only on its own
seed and history, not on what else is in the batch: on the CPU it comes from the request's own
generator, on the GPU from a Philox stream keyed by (seed, position) inside one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steerable.engine.request import Request
from steerable.layers import fused

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
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def add_request(self, request: Request) -> None:
        if request.params.seed is not None:
            g = torch.Generator(device=self.device)
            g.manual_seed(request.params.seed)
            self.request_generators[request.request_id] = g

    def remove_request(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> "SampleHandle":
        """Enqueue sampling of logits [S, V] (one row per request, in order; any float dtype, used
        as float32); nothing here waits for the device. ``finalize`` brings the tokens (and
        logprobs) to the host."""
        self._suppress_early_stops(logits, requests)
        want = [None if r.params.logprobs is None else (r.params.logprobs, r.params.logprob_token_ids or [])
                for r in requests]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(n is not None for n in want) else None
        if fused.enabled(logits) and not any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p
                                             for r in requests):
            tokens = self._fused(logits, requests)  # reads the logits in their own dtype
        else:
            tokens = self._torch(logits.float(), requests)
        host = tokens.to("cpu", non_blocking=True) if tokens.is_cuda else tokens
        done = torch.cuda.Event() if tokens.is_cuda else None
        if done is not None:
            done.record()
        return SampleHandle(tokens, host, done, raw_logprobs, want)

    def finalize(self, handle: "SampleHandle") -> tuple[list[int], list[dict | None]]:
        if handle.done is not None:
            handle.done.synchronize()
        token_list = handle.host.tolist()
        logprobs: list[dict | None] = [None] * len(token_list)
        if handle.raw_logprobs is not None:
            for i, asked in enumerate(handle.logprobs):
                if asked is not None:
                    logprobs[i] = requested_logprobs(handle.raw_logprobs[i], token_list[i], *asked)
        return token_list, logprobs

    def _fused(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """GPU: one kernel samples every row; the noise of a row depends only on its request's seed
        and the position being sampled, so it is reproducible and independent of the batch."""
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        seeds = torch.tensor([((r.params.seed if r.params.seed is not None else r.sampling_seed) * _MIX_A
                               + r.num_tokens * _MIX_B) & _MASK for r in requests], dtype=torch.int64)
        return fused.gumbel_argmax(logits, temperature.to(logits.device, non_blocking=True),
                                   seeds.to(logits.device, non_blocking=True))

    def _torch(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in sampled])
        return tokens

    def _suppress_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> None:
        for i, request in enumerate(requests):
            if request.num_output_tokens < request.params.min_tokens and request.stop_token_ids:
                logits[i, list(request.stop_token_ids)] = float("-inf")

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=device, dtype=torch.float32)
        logits = logits / temperature[:, None]
        top_k = [r.params.top_k for r in requests]
        if any(top_k):
            k = torch.tensor([t if t > 0 else logits.shape[-1] for t in top_k], device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k.clamp(max=logits.shape[-1]) - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = [r.params.top_p for r in requests]
        if any(p < 1.0 for p in top_p):
            p = torch.tensor(top_p, device=device, dtype=torch.float32)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p[:, None]
            probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
        min_p = [r.params.min_p for r in requests]
        if any(min_p):
            threshold = torch.tensor(min_p, device=device, dtype=torch.float32)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        unseeded = []
        for i, request in enumerate(requests):
            g = self.request_generators.get(request.request_id)
            if g is None:
                unseeded.append(i)
            else:
                noise[i].exponential_(generator=g)
        if unseeded:
            rows = torch.tensor(unseeded, device=device)
            noise[rows] = torch.empty(len(unseeded), probs.shape[-1], device=device).exponential_(
                generator=self.generator)
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
