"""The chat workload (one shared system prompt): capture, steering and prefix caching against plain.

N chats share one system prompt (``--system-len`` tokens), each adds U(user) tokens of its own and
generates U(output) tokens (temperature 0.6, ``ignore_eos``), prefix caching on; every run uses a
fresh ``cache_salt``, so each computes the system prompt once. Modes on ONE engine, interleaved
round by round after one full warm-up run each (which captures the graphs a mode's capture plan
needs), medians of ``--repeats`` rounds:

- ``plain``: no capture, no steering (prefix caching and shared-prefix attention on);
- ``capture_last_prompt``: every request captures its last prompt token at every layer
  (``CaptureSpec(layers=None, select="last_prompt")``); ``..._one_layer``: at the middle layer only;
  ``..._stream``: the same rows through a capture stream (``start_capture``);
- ``capture_all_prompt``: every prompt row at the middle layer, per request: on a prefix hit the
  system prompt's rows come from the activation store (``--activation-store-bytes``);
- ``capture_generated``: every generated token's input row at the middle layer, per request;
- ``steer_decode``: a decode-only steering vector at every layer (prompt blocks stay shareable);
- ``cache_off``: no request reads the prefix cache (``skip_reading_prefix_cache``);
- ``shared_prefix_off``: prefix caching without shared-prefix attention (the step builder's
  detector off).

One ``mode`` record per mode, ``{"bench": "chat", "record": "mode", "mode": M, "output_tok_s": x,
"cost_pct_vs_plain": c}`` with c = (1 - x / plain's x) * 100 (percent below plain), a ``run`` record
with each mode's raw times and engine counters per run (steps, graph replays and captures, steps
that captured rows without a graph, shared-prefix steps, prefix-cache and activation-store hits),
and a ``ratio`` record: plain's speedup over caching off and over caching without shared-prefix
attention (the round-3 target; this benchmark replaces ``shared_prefix``). Captured row counts are
checked (one row per request and layer, every prompt row, every generated input row); a wrong count
exits non-zero, as does a GPU run whose plain mode took no shared-prefix step.

    python -m benchmarks chat [--system-len 1200] [--num-requests 512] [--user-len 20 200]
        [--output-len 20 400] [--repeats 3] [--modes M,...] [--activation-store-bytes N]
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from . import common
from .common import emit, timed

MODES = ("plain", "capture_last_prompt", "capture_last_prompt_one_layer", "capture_last_prompt_stream",
         "capture_all_prompt", "capture_generated", "steer_decode", "cache_off", "shared_prefix_off")
STREAM = "hidden_states"
COUNTERS = ("num_steps", "graph_replays", "graph_captures", "capture_eager_steps", "shared_prefix_steps",
            "prefix_cache_hit_tokens", "activation_store_hits", "activation_store_misses")


def chat_workload(args, vocab: int) -> common.Workload:
    """One system prompt, then per chat U(user) own tokens; outputs U(output) tokens (seeded)."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.system_len).tolist()
    users = rng.integers(args.user_len[0], args.user_len[1] + 1, args.num_requests)
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests).tolist()
    prompts = [system + rng.integers(0, vocab, int(n)).tolist() for n in users]
    return common.Workload(prompts, [len(p) for p in prompts], outputs)


def mode_settings(llm, mode: str) -> tuple[dict[str, Any], dict | None, list[int]]:
    """(SamplingParams extras shared by every request, the stream to start or None, captured layers)."""
    from steerable import CaptureSpec, SteeringSpec

    layers = llm.list_steerable_layers()["post_mlp"]
    middle = [layers[len(layers) // 2]]
    if mode == "capture_last_prompt":
        return {"capture": CaptureSpec(layers=None, select="last_prompt")}, None, layers
    if mode == "capture_last_prompt_one_layer":
        return {"capture": CaptureSpec(layers=middle, select="last_prompt")}, None, middle
    if mode == "capture_last_prompt_stream":
        return {}, {"layers": None, "select": "last_prompt"}, layers
    if mode == "capture_all_prompt":
        return {"capture": CaptureSpec(layers=middle, select="all_prompt")}, None, middle
    if mode == "capture_generated":
        return {"capture": CaptureSpec(layers=middle, select="all_generated")}, None, middle
    if mode == "steer_decode":
        hidden = llm.llm_engine.model_config.hidden_size
        vector = np.random.default_rng(1).standard_normal(hidden).astype(np.float32) * 0.01
        return {"steering_vectors": SteeringSpec(decode_vectors={layer: vector for layer in layers})}, None, []
    if mode == "cache_off":
        return {"skip_reading_prefix_cache": True}, None, []
    return {}, None, []


def expected_rows(mode: str, prompt_len: int, generated: int) -> int:
    """Rows per layer one request of ``mode`` captures."""
    if mode == "capture_all_prompt":
        return prompt_len
    if mode == "capture_generated":
        return generated - 1
    return 1


def rows_ok(mode: str, outs, layers: list[int], stream: tuple | None) -> bool:
    if stream is not None:
        tensors, _ = stream
        return all(int(tensors[layer].shape[0]) == len(outs) for layer in layers)
    for out in outs:
        captured = out.captures.get(STREAM, {})
        want = expected_rows(mode, len(out.prompt_token_ids), len(out.outputs[0].token_ids))
        if sorted(captured) != layers or any(int(captured[layer].shape[0]) != want for layer in layers):
            return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--system-len", type=int, default=None, help="tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds after the warm-up; medians are reported")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)} (plain always runs)")
    p.add_argument("--activation-store-bytes", type=int, default=2**30,
                   help="host memory for captured prompt rows served on prefix hits (default: 1 GiB)")
    args = p.parse_args(argv)
    chosen = args.modes.split(",")
    if set(chosen) - set(MODES):
        p.error(f"unknown modes {sorted(set(chosen) - set(MODES))}; expected some of {list(MODES)}")
    modes = ["plain", *[m for m in MODES if m in chosen and m != "plain"]]
    path = common.setup("chat", args, {"num_requests": (512, 12), "system_len": (1200, 48),
                                       "user_len": ((20, 200), (2, 12)), "output_len": ((20, 400), (2, 10))})
    llm = common.make_llm(args, path, activation_store_bytes=args.activation_store_bytes)
    engine = llm.llm_engine
    detector = engine.builder.shared_prefix  # None where the backend has no shared-prefix kernel (CPU)
    w = chat_workload(args, common.prompt_vocab(llm))
    settings = {mode: mode_settings(llm, mode) for mode in modes}

    def run(mode: str, salt: str) -> dict:
        """One full run of the workload in ``mode`` (the warm-up is one too: the steady state's
        mixed steps, whose graphs a capture plan keys, only occur in it)."""
        extra, stream, layers = settings[mode]
        engine.builder.shared_prefix = None if mode == "shared_prefix_off" else detector
        before = {**engine.stats(), **eager_capture_steps()}
        if stream is not None:
            llm.start_capture(STREAM, **stream)
        try:
            params = common.sampling_params(w, salt, [extra] * len(w))
            outs, seconds = timed(partial(llm.generate, w.prompts, params, use_tqdm=False))
        finally:
            fetched = None
            if stream is not None:
                llm.stop_capture(STREAM)
                fetched = llm.fetch_captured(STREAM)
                llm.clear_captured(STREAM)
        after = {**engine.stats(), **eager_capture_steps()}
        checked = rows_ok(mode, outs, layers, fetched) if layers else True
        return {"seconds": seconds, "tokens": common.generated_tokens(outs), "rows_ok": checked,
                **{k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}}

    def eager_capture_steps() -> dict:
        """Steps that captured rows without replaying a graph (every one on a CPU)."""
        return {"capture_eager_steps": llm.capture_status(STREAM)["eager_capture_forwards"]}

    warm = {mode: run(mode, f"warmup-{mode}") for mode in modes}
    results = {mode: [] for mode in modes}
    for r in range(args.repeats):  # interleaved: slow drift of the machine hits every mode alike
        for mode in modes:
            results[mode].append(run(mode, f"{mode}-{r}"))
    engine.builder.shared_prefix = detector
    medians = {mode: results[mode][-1]["tokens"] / common.median([r["seconds"] for r in results[mode]])
               for mode in modes}
    ok = True
    for mode in modes:
        rounds = results[mode]
        ok &= all(r["rows_ok"] for r in rounds) and warm[mode]["rows_ok"]
        emit({"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats,
              "system_len": args.system_len, "captured_layers": len(settings[mode][2]),
              "seconds_all": [r["seconds"] for r in rounds], "rows_ok": all(r["rows_ok"] for r in rounds),
              "warmup": warm[mode], **{k: [r[k] for r in rounds] for k in COUNTERS},
              **common.throughput(common.median([r["seconds"] for r in rounds]), sum(w.input_lens),
                                  rounds[-1]["tokens"])})
    for mode in modes:
        emit({"record": "mode", "mode": mode, "output_tok_s": medians[mode],
              "cost_pct_vs_plain": (1 - medians[mode] / medians["plain"]) * 100})
    ratios = {f"speedup_vs_{name}": medians["plain"] / medians[mode]
              for name, mode in (("cache_off", "cache_off"), ("cache_on", "shared_prefix_off")) if mode in modes}
    if ratios:
        emit({"record": "ratio", **ratios})
    llm.shutdown()
    if not ok:
        raise SystemExit("captured row counts differ from one row per request and layer (or every prompt / "
                         "generated row)")
    if detector is not None and not results["plain"][-1]["shared_prefix_steps"]:
        raise SystemExit("the plain mode ran no shared-prefix step")

