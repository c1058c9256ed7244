"""A top-k SAE's training loop in plain torch: what SAELens' ``SAETrainer`` does to a
``TopKTrainingSAE``, without the library (the benchmark GPU machines do not have it).

SAELens 6 with its defaults (``rescale_acts_by_decoder_norm``, ``apply_b_dec_to_input``,
``decoder_init_norm=0.1``, ``aux_loss_coefficient=1``, ``dead_feature_window=1000``, no autocast,
Adam at a constant 3e-4, betas 0.9 / 0.999, gradients clipped to norm 1), float32:

- init: ``W_dec`` [d_sae, d_in] Kaiming-uniform, rows scaled to norm 0.1, ``W_enc = W_dec.T``,
  ``b_enc``, ``b_dec`` zero (the same draws as SAELens after the same ``torch.manual_seed``);
- step: ``pre = ((x - b_dec) @ W_enc + b_enc) * |W_dec|`` (row norms), the ``k`` largest of each
  row kept and ReLU'd, ``out = (acts / |W_dec|) @ W_dec + b_dec``; loss = squared error summed over
  ``d_in``, averaged over rows, plus the auxiliary loss of the dead latents (those that fired in
  none of the last ``dead_feature_window`` steps: the top ``d_in / 2`` of them reconstruct the
  residual); backward, clip, Adam step.

The bookkeeping is kept as SAELens keeps it (firing counts, steps since each latent fired, the
count of dead latents read on the host every step, a boolean-mask write), so a step synchronises
with the device where SAELens' does and costs what it costs. Logging, checkpoints and wandb are
off, as in a run without them. ``tests/test_benchmarks_planes.py`` checks the weights step for step
against SAELens on a CPU; ``SAELensTrainer`` is SAELens' own, for machines that have it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

LR = 3e-4
DEAD_FEATURE_WINDOW = 1000


class TopKTrainer:
    """One top-k SAE and its Adam state; ``fit`` trains it on ``tokens`` rows of a provider."""

    def __init__(self, d_in: int, d_sae: int, k: int, batch_size: int, device: str | torch.device, seed: int,
                 lr: float = LR, dead_feature_window: int = DEAD_FEATURE_WINDOW):
        self.k, self.batch_size, self.dead_feature_window = k, batch_size, dead_feature_window
        self.device = torch.device(device)
        torch.manual_seed(seed)  # the same initial SAE in every run, and as SAELens draws it
        w_dec = torch.empty(d_sae, d_in, device=self.device)
        torch.nn.init.kaiming_uniform_(w_dec)
        w_dec /= w_dec.norm(dim=-1, keepdim=True)
        w_dec *= 0.1
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in, device=self.device))
        self.W_dec = torch.nn.Parameter(w_dec)
        self.W_enc = torch.nn.Parameter(w_dec.T.clone().contiguous())
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae, device=self.device))
        self.params = [self.b_dec, self.W_dec, self.W_enc, self.b_enc]  # SAELens' registration order
        self.optimizer = torch.optim.Adam(self.params, lr=lr, betas=(0.9, 0.999))
        self.since_fired = torch.zeros(d_sae, device=self.device)
        self.act_freq_scores = torch.zeros(d_sae, device=self.device)
        self.samples = self.steps = 0

    def fit(self, provider: Iterator[torch.Tensor], tokens: int) -> None:
        while self.samples < tokens:
            self.step(next(provider))

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.to(self.device).to(torch.float32)
        self.samples += len(x)
        dead = self.since_fired > self.dead_feature_window  # before this step's update, as SAELens passes it
        hidden_pre = ((x - self.b_dec) @ self.W_enc + self.b_enc) * self.W_dec.norm(dim=-1)
        values, indices = torch.topk(hidden_pre, self.k, dim=-1, sorted=False)
        acts = torch.zeros_like(hidden_pre).scatter_(-1, indices, values.relu())
        out = self._decode(acts) + self.b_dec
        loss = F.mse_loss(out, x, reduction="none").sum(dim=-1).mean() + self._aux_loss(x, out, hidden_pre, dead)
        with torch.no_grad():
            firing = acts.bool().float()
            self.since_fired += 1
            self.since_fired[firing.sum(-2).bool()] = 0
            self.act_freq_scores += firing.sum(0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return loss.detach()

    def _decode(self, acts: torch.Tensor) -> torch.Tensor:
        return (acts * (1 / self.W_dec.norm(dim=-1))) @ self.W_dec

    def _aux_loss(self, x: torch.Tensor, out: torch.Tensor, hidden_pre: torch.Tensor,
                  dead: torch.Tensor) -> torch.Tensor:
        """The dead latents' top ``d_in / 2`` reconstruct what the live ones left (0 with none dead)."""
        num_dead = int(dead.sum())  # a host read every step, as in SAELens
        if num_dead == 0:
            return out.new_tensor(0.0)
        residual = (x - out).detach()
        k_aux = x.shape[-1] // 2
        scale = min(num_dead / k_aux, 1.0)
        top = torch.where(dead[None], hidden_pre, -torch.inf).topk(min(k_aux, num_dead), sorted=False)
        aux_acts = torch.zeros_like(hidden_pre).scatter_(-1, top.indices, top.values)
        return scale * (self._decode(aux_acts) - residual).pow(2).sum(dim=-1).mean()


class SAELensTrainer:
    """SAELens' ``TopKTrainingSAE`` and ``SAETrainer`` with the settings ``TopKTrainer`` copies."""

    def __init__(self, d_in: int, d_sae: int, k: int, batch_size: int, device: str | torch.device, seed: int,
                 lr: float = LR, dead_feature_window: int = DEAD_FEATURE_WINDOW):
        from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig

        self.batch_size, self.device, self.lr, self.dead_feature_window = batch_size, str(device), lr, dead_feature_window
        torch.manual_seed(seed)
        self.sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k, dtype="float32",
                                                         device=self.device))
        self.W_dec = self.sae.W_dec

    def fit(self, provider: Iterator[torch.Tensor], tokens: int) -> None:
        from sae_lens import SAETrainer
        from sae_lens.config import SAETrainerConfig

        cfg = SAETrainerConfig(total_training_samples=tokens, train_batch_size_samples=self.batch_size,
                               device=self.device, lr=self.lr, lr_end=self.lr, n_batches_for_norm_estimate=1,
                               dead_feature_window=self.dead_feature_window)
        SAETrainer(cfg, self.sae, provider).fit()


TRAINERS = {"torch": TopKTrainer, "saelens": SAELensTrainer}
