"""What every route reads: the engine, the server's settings, keys, metrics and what the model
offers for capture. One ``ServerState`` per app, at ``app.state.server``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from steerable.entrypoints.async_llm import AsyncLLM
from steerable.entrypoints.openai.auth import Keys
from steerable.entrypoints.openai.errors import APIError
from steerable.entrypoints.openai.extensions import CaptureInfo
from steerable.entrypoints.openai.metrics import Metrics


@dataclass
class ServerSettings:
    served_model_name: str
    api_keys: list[str] = field(default_factory=list)
    admin_api_key: str | None = None
    max_body_bytes: int = 32 * 2**20
    max_capture_bytes: int = 64 * 2**20
    chat_template: str | None = None  # overrides the tokenizer's
    dashboards: dict[str, Any] = field(default_factory=dict)  # SAE name -> FeatureDashboards (--dashboards)
    tool_call_parser: str | None = None  # --enable-auto-tool-choice --tool-call-parser NAME
    reasoning_parser: str | None = None  # --reasoning-parser NAME
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    neuronpedia: bool = False  # the Neuronpedia inference API under /neuronpedia/v1
    neuronpedia_source_sets: dict[str, list[str]] = field(default_factory=dict)  # set name -> registered SAEs


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: ServerSettings
    keys: Keys
    metrics: Metrics
    capture: CaptureInfo
    created: int

    def check_model(self, model: str | None) -> None:
        """A request may omit ``model``; naming another one is a 404, as OpenAI answers."""
        if model is not None and model != self.settings.served_model_name:
            raise APIError(404, f"model: {model!r} does not exist; this server serves "
                                f"{self.settings.served_model_name!r}", "model")


def server_state(request: Request) -> ServerState:
    return request.app.state.server
