"""The steering-vector toolkit: contrast pairs -> activations (the engine's own capture) -> a
direction per layer -> a steered model -> a measured effect, plus llama.cpp/repeng GGUF interop.

    from steerable.vectors import ControlVector, train, evaluate
"""

from steerable.vectors.combine import combine_control_vectors, parse_control_vector_arg
from steerable.vectors.control_vector import ControlVector
from steerable.vectors.datafiles import demo_items, demo_pairs, neutral_prompts, parse_pairs, read_items, read_pairs
from steerable.vectors.evaluate import EvalReport, EvalRow, evaluate
from steerable.vectors.extract import METHODS
from steerable.vectors.items import ABItem
from steerable.vectors.reft import load_reft
from steerable.vectors.train import train

__all__ = ["ControlVector", "train", "evaluate", "load_reft", "ABItem", "EvalReport", "EvalRow", "METHODS",
           "combine_control_vectors", "parse_control_vector_arg", "read_pairs", "read_items", "parse_pairs",
           "demo_pairs", "demo_items", "neutral_prompts"]
