"""``steerable serve``: an OpenAI-compatible HTTP server (as vLLM serves it) with steering and
capture in the request body and admin routes for global steering, modules and capture streams."""

from steerable.entrypoints.openai.app import build_app, run_server
from steerable.entrypoints.openai.state import ServerSettings

__all__ = ["build_app", "run_server", "ServerSettings"]
