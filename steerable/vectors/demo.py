"""The demo recipe (``steerable demo``): a sentiment vector trained from the shipped contrast pairs,
swept over scales on the held-out items, and greedy generations at -s, 0 and +s.

The choices are SmolLM2-135M-Instruct's (30 layers): the vector is read at the last token of each
pair sentence (``mean_diff``) and added at every token of the layers from 20 % to 47 % of the
depth (6-14 there), and one unit of scale is 2.5 % of the mean residual norm at each of those
layers (``ControlVector.normalized(relative=True)``), so a unit means the same push on any model.
At that unit, p(positive completion) on the held-out items rises monotonically over -2 … 2 and the
KL on neutral text stays under one nat; the generations use ±3 units, where the tone is obvious.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from steerable.sampling_params import SamplingParams
from steerable.vectors.control_vector import ControlVector
from steerable.vectors.datafiles import demo_items, demo_pairs
from steerable.vectors.evaluate import EvalReport, evaluate
from steerable.vectors.train import train

SCALES = (-2.0, -1.0, 0.0, 1.0, 2.0)
UNIT = 0.025  # fraction of the residual norm per unit of scale
DEPTH = (0.2, 0.47)  # first and last steered layer, as fractions of the model's depth
PROMPT = "How was the party last night?"


@dataclass
class DemoResult:
    vector: ControlVector  # one unit of scale
    report: EvalReport
    generations: dict[float, str]  # scale -> greedy completion of PROMPT
    pairs: int


def demo_layers(num_layers: int) -> range:
    return range(round(DEPTH[0] * num_layers), round(DEPTH[1] * num_layers) + 1)


def run_demo(llm: Any, scales: Sequence[float] = SCALES, generation_scale: float = 3.0,
             max_tokens: int = 40, use_tqdm: bool = False) -> DemoResult:
    """Train, evaluate on the held-out items at ``scales``, generate at -s, 0, +s."""
    positives, negatives = demo_pairs()
    layers = demo_layers(llm.llm_engine.model_config.num_layers)
    trained = train(llm, positives, negatives, layers=layers, method="mean_diff", token="last", use_tqdm=use_tqdm)
    unit = trained.normalized(relative=True) * UNIT
    report = evaluate(llm, unit, demo_items(), scales=scales)
    chosen = [-generation_scale, 0.0, generation_scale]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, steering_vectors=unit.to_spec(s)) for s in chosen]
    outs = llm.chat([[{"role": "user", "content": PROMPT}]] * len(chosen), params, use_tqdm=False)
    return DemoResult(unit, report, {s: out.outputs[0].text.strip() for s, out in zip(chosen, outs)}, len(positives))
