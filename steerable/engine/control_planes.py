"""The engine's control-plane calls: steering (global vectors, named modules), the SAE registry and
capture streams. Each takes the engine lock, so a server's handlers change them between steps and a
step never sees half a change; the planes themselves live in their packages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from steerable.errors import InvalidRequestError
from steerable.sae.model import SAE
from steerable.sae.transcoder import Transcoder
from steerable.steering.spec import SteeringSpec


class ControlPlanes:
    """Mixed into ``LLMEngine``: thin, locked entry points to ``self.steering``, ``self.saes`` and
    ``self.capture``."""

    def set_steering_vectors(self, spec: Any, replace: bool = True) -> None:
        with self.lock.hold():
            self.steering.set_global(spec, replace)

    def clear_steering_vectors(self) -> None:
        with self.lock.hold():
            self.steering.clear_global()

    def register_steering_modules(self, modules: dict[str, Any]) -> None:
        with self.lock.hold():
            self.steering.register_modules(modules)

    def unregister_steering_modules(self, names: str | Sequence[str]) -> None:
        with self.lock.hold():
            self.steering.unregister_modules(names)

    def get_steering_module(self, name: str) -> SteeringSpec:
        with self.lock.hold():
            return self.steering.module_spec(name)

    def list_steerable_layers(self) -> dict[str, list[int]]:
        return self.steering.steerable_layers()

    def get_steering_status(self) -> dict[str, Any]:
        with self.lock.hold():
            return self.steering.status()

    def register_sae(self, name: str, sae: SAE | Transcoder) -> None:
        with self.lock.hold():
            self.capture.features.register(name, self.saes.register(name, sae))  # shipped with the next step

    def list_saes(self) -> dict[str, dict[str, Any]]:
        with self.lock.hold():
            return self.saes.describe()

    def get_sae(self, name: str) -> SAE:
        with self.lock.hold():
            return self.saes.get(name, "name")

    def unregister_sae(self, name: str) -> None:
        """Refused while steering (global, a module, a live request) or capture uses the SAE."""
        with self.lock.hold():
            self.saes.get(name, "name")
            capturing = self.capture.features.in_use(name)
            users = [*self.steering.sae_users(name), *([capturing] if capturing else [])]
            if users:
                raise InvalidRequestError(f"name: SAE {name!r} is in use by {', '.join(users)}")
            self.saes.remove(name)
            self.capture.features.unregister(name)

    def start_capture(self, stream: str, layers: Sequence[int] | None, dtype: str | None, reduce: str, select: Any,
                      budget_rows: int | None, hook: str, sink: Any = None, saes: Sequence[str] | None = None,
                      top_k: int = 32) -> None:
        """``sink``: see ``CaptureSession.start`` (in-process callers only)."""
        with self.lock.hold():
            self.capture.start(stream, layers, dtype, reduce, select, budget_rows, hook, sink, saes, top_k)

    def stop_capture(self, stream: str) -> None:
        with self.lock.hold():
            self.capture.stop(stream)

    def fetch_captured(self, stream: str, clear: bool, layers: Sequence[int] | None,
                       req_ids: Sequence[str] | None) -> tuple[dict, dict]:
        with self.lock.hold():
            return self.capture.fetch(stream, clear, layers, req_ids)

    def clear_captured(self, stream: str) -> None:
        with self.lock.hold():
            self.capture.clear(stream)

    def capture_status(self, stream: str) -> dict[str, Any]:
        with self.lock.hold():
            return self.capture.status(stream)

    def add_capture_consumer(self, consumer: Any) -> None:
        with self.lock.hold():
            self.capture.consumers.append(consumer)

    def remove_capture_consumer(self, consumer: Any) -> None:
        with self.lock.hold():
            self.capture.consumers.remove(consumer)
