"""HF transformers as the oracle for steering and capture: forward hooks at the equivalent points.

pre_attn  L = input of decoder layer L (forward pre-hook on the layer)
post_attn L = residual after the attention add (hook on the output of the branch added to the residual:
              self_attn, or post_attention_layernorm where a norm follows it, as in Gemma and OLMo-2;
              for parallel-residual GPT-NeoX the layer input + the attention output)
post_mlp  L = output of decoder layer L (forward hook on the layer)
mlp_in    L = input of the layer's MLP module (forward pre-hook on it)
mlp_out   L = what the MLP block adds to the residual: the output of the post-feed-forward norm where
              the layer has one (Gemma, OLMo-2), else of the MLP module (the experts' sum for MoE)
Greedy decoding recomputes the whole sequence each step (no KV cache), so a hook sees every
position with its absolute index and the oracle shares no code or state with the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from steerable.selection import SelectSpec

# fn(hidden [T, H] float, positions [T]) -> new hidden; applied to the rows the select picks.
Edit = tuple[str, int, Callable[[torch.Tensor], torch.Tensor], SelectSpec | None]


def add_edit(vector) -> Callable[[torch.Tensor], torch.Tensor]:
    v = torch.as_tensor(vector, dtype=torch.float32)
    return lambda h: h + v


def clamp_edit(direction, lo=None, hi=None, strength=1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    d = torch.as_tensor(direction, dtype=torch.float32)
    d = d / d.norm()

    def fn(h: torch.Tensor) -> torch.Tensor:
        p = h @ d
        target = p.clamp(min=lo, max=hi)
        return h + (strength * (target - p)).unsqueeze(-1) * d
    return fn


def decoder_layers(model) -> list:
    """The decoder layers of an HF causal LM: ``model.layers`` (the text tower's in a multimodal
    model), GPT-2's ``transformer.h``, GPT-NeoX's ``gpt_neox.layers``."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    body = model.gpt_neox if hasattr(model, "gpt_neox") else model.model
    return getattr(body, "language_model", body).layers


def attention_parts(layer) -> tuple:
    """(the module whose output is added to the residual as the attention branch, the output
    projection whose input is the per-head attention output) of one HF decoder layer. With
    post-normed branches (Gemma, OLMo-2) the branch is the post-attention norm; for parallel-residual GPT-NeoX
    the attention itself, so ``post_attn`` = layer input + attention output."""
    if hasattr(layer, "attn"):  # GPT-2
        return layer.attn, layer.attn.c_proj
    if hasattr(layer, "attention"):  # GPT-NeoX
        return layer.attention, layer.attention.dense
    sandwich = hasattr(layer, "post_feedforward_layernorm")  # Gemma, OLMo-2: post-normed branches
    return (layer.post_attention_layernorm if sandwich else layer.self_attn), layer.self_attn.o_proj


def mlp_parts(layer) -> tuple:
    """(the MLP module, the module whose output is what the residual adds for the MLP branch)."""
    return layer.mlp, getattr(layer, "post_feedforward_layernorm", layer.mlp)


def _first(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else next(iter(kwargs.values()))


class HFSteered:
    """Install edits on an HF model for one forward over ``ids`` (prompt length ``prompt_len``)."""

    def __init__(self, model, edits: list[Edit]):
        self.model = model
        self.edits = edits

    def _rows(self, select: SelectSpec | None, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        n = ids.shape[-1]
        if select is None:
            return torch.ones(n, dtype=torch.bool)
        return select.mask(torch.arange(n), prompt_len, ids[0])

    def forward(self, ids: torch.Tensor, prompt_len: int, capture: dict | None = None):
        layers = decoder_layers(self.model)
        handles = []
        layer_inputs: dict[int, torch.Tensor] = {}

        def apply(point, layer, hidden):
            for p, l, fn, select in self.edits:
                if (p, l) == (point, layer):
                    rows = self._rows(select, ids, prompt_len)
                    hidden = hidden.clone()
                    hidden[0, rows] = fn(hidden[0, rows])
            return hidden

        for i, layer in enumerate(layers):
            def pre(mod, args, kwargs, i=i):
                hidden = args[0] if args else kwargs["hidden_states"]
                hidden = apply("pre_attn", i, hidden)
                layer_inputs[i] = hidden
                if capture is not None:
                    capture[("pre_attn", i)] = hidden[0].detach().clone()
                if args:
                    return (hidden, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": hidden}

            def attn_out(mod, args, output, i=i):
                attn = output[0] if isinstance(output, tuple) else output
                residual = layer_inputs[i]
                after = apply("post_attn", i, residual + attn)
                if capture is not None:
                    capture[("post_attn", i)] = after[0].detach().clone()
                new = after - residual if any(p == "post_attn" and l == i for p, l, _, _ in self.edits) else attn
                return (new, *output[1:]) if isinstance(output, tuple) else new

            def post(mod, args, output, i=i):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden = apply("post_mlp", i, hidden)
                if capture is not None:
                    capture[("post_mlp", i)] = hidden[0].detach().clone()
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

            def heads(mod, args, i=i):
                if capture is not None:
                    capture[("attention_heads", i)] = args[0][0].detach().clone()

            def mlp_in(mod, args, kwargs, i=i):
                hidden = apply("mlp_in", i, _first(args, kwargs))
                if capture is not None:
                    capture[("mlp_in", i)] = hidden[0].detach().clone()
                if args:
                    return (hidden, *args[1:]), kwargs
                return args, {**kwargs, next(iter(kwargs)): hidden}

            def mlp_out(mod, args, output, i=i):
                hidden = apply("mlp_out", i, output[0] if isinstance(output, tuple) else output)
                if capture is not None:
                    capture[("mlp_out", i)] = hidden[0].detach().clone()
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            branch, out_proj = attention_parts(layer)
            handles.append(branch.register_forward_hook(attn_out))
            handles.append(layer.register_forward_hook(post))
            handles.append(out_proj.register_forward_pre_hook(heads))
            mlp, mlp_output = mlp_parts(layer)
            handles.append(mlp.register_forward_pre_hook(mlp_in, with_kwargs=True))
            handles.append(mlp_output.register_forward_hook(mlp_out))
        try:
            with torch.no_grad():
                return self.model(ids, use_cache=False).logits[0].float()
        finally:
            for h in handles:
                h.remove()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the log-softmax rows that chose them ([max_new_tokens, V])."""
        ids = list(prompt_ids)
        rows = []
        for _ in range(max_new_tokens):
            logits = self.forward(torch.tensor([ids]), len(prompt_ids))[-1]
            rows.append(torch.log_softmax(logits, -1))
            ids.append(int(logits.argmax()))
        return ids[len(prompt_ids):], torch.stack(rows)


def max_logprob_gap(output, ref_logprobs: torch.Tensor) -> float:
    """Largest |Δ logprob| over the tokens the engine reported at each step."""
    gap = 0.0
    for step, entry in enumerate(output.outputs[0].logprobs):
        for token, lp in entry.items():
            gap = max(gap, abs(lp.logprob - ref_logprobs[step, token].item()))
    return gap


def check_steered_greedy(llm, hf, prompt_ids: list[int], steering, edits: list[Edit], n: int,
                         tolerance: float = 1e-4):
    """The engine steered with ``steering`` equals HF with ``edits`` (greedy tokens identical,
    logprobs within ``tolerance``), and the steering visibly changes the output (so a no-op fails)."""
    from steerable import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5, steering_vectors=steering)
    out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    ref_tokens, ref_lp = HFSteered(hf, edits).greedy(prompt_ids, n)
    assert out.outputs[0].token_ids == ref_tokens
    assert max_logprob_gap(out, ref_lp) <= tolerance
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(prompt_ids, n)
    assert plain_tokens != ref_tokens or (ref_lp - plain_lp).abs().max().item() > 0.05, "no visible effect"
    return out
