"""The Neuronpedia inference API (``neuronpedia-inference-client`` 1.10.1, API 1.9.0) under
``/neuronpedia/v1``, so a self-hosted Neuronpedia, or a script written against that client, can use
steerable as its inference server: steering (``/steer/completion``, ``/steer/completion-chat``),
SAE activations (``/activation/*``), ``/tokenize`` and the SAE utilities (``/util/*``). Mounted by
``steerable serve MODEL --neuronpedia``; see docs/neuronpedia.md."""

from __future__ import annotations

from fastapi import FastAPI

from steerable.entrypoints.neuronpedia import activations, steer, utilities
from steerable.entrypoints.neuronpedia.context import NeuronpediaState

PREFIX = "/neuronpedia/v1"


def mount(app: FastAPI, source_sets: dict[str, list[str]]) -> None:
    """Add the routes to ``app`` (whose ``state.server`` is set) with their state."""
    app.state.neuronpedia = NeuronpediaState(source_sets)
    for part in (steer.router, activations.router, utilities.router):  # each of NeuronpediaRoute
        app.include_router(part, prefix=PREFIX)
