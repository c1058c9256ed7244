"""What the Neuronpedia routes share: the served model's name and shape, prompts tokenized as the
reference tokenizes them (BOS prepended when missing), token strings, TransformerLens hook names,
the registered SAEs by ``source`` name, source sets, and the server process's copies of SAE
weights (decoder rows for steering and the utilities; encoding runs in the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from steerable.entrypoints.neuronpedia.route import NeuronpediaError
from steerable.entrypoints.openai.state import ServerState
from steerable.errors import InvalidRequestError
from steerable.hook_points import RESIDUAL_POINTS, Site, transformer_lens_site
from steerable.sae.model import SAE

ATTENTION_OUTPUT = ".attn.hook_z"


@dataclass
class SaeCopies:
    """SAE weights in the server process, fetched from the engine on first use and again only when
    the engine's SAE under that name changed (``LLM.get_sae(name, known_hash)``: one round trip to
    the engine, which answers None while the copy is current); a name no longer registered is
    dropped when asked for, or whenever the registry is read."""

    copies: dict[str, SAE] = field(default_factory=dict)

    async def get(self, llm: Any, name: str) -> SAE:
        known = self.copies.get(name)
        try:
            fresh = await llm.get_sae(name, None if known is None else known.content_hash)
        except InvalidRequestError:
            self.copies.pop(name, None)
            raise
        if fresh is not None:
            self.copies[name] = fresh
        return self.copies[name]

    def keep_only(self, names: set[str]) -> None:
        for name in set(self.copies) - names:
            del self.copies[name]


@dataclass
class NeuronpediaState:
    """The router's own state beside the server's: source sets (``--neuronpedia-source-set``),
    SAE copies, and the tokenizer's special token ids (read once)."""

    source_sets: dict[str, list[str]]
    saes: SaeCopies = field(default_factory=SaeCopies)
    special_ids: frozenset[int] | None = None


class Context:
    """One request's view of the server: ``ctx = Context(request)``."""

    def __init__(self, request: Request):
        self.request = request
        self.server: ServerState = request.app.state.server
        self.state: NeuronpediaState = request.app.state.neuronpedia
        self.llm = self.server.llm
        self.tokenizer = self.llm.tokenizer
        config = self.llm.model_config
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_layers
        self._registered: dict[str, dict[str, Any]] | None = None  # read once per request
        self._weights: dict[str, SAE] = {}

    # ------------------------------------------------------------ names

    def check_model(self, model: str, where: str = "model") -> None:
        served = self.server.settings.served_model_name
        if model != served:
            raise NeuronpediaError(404, f"{where}: model {model!r} is not served here; this server serves {served!r}")

    async def saes(self) -> dict[str, dict[str, Any]]:
        """The registered SAEs (``{name: {"layer", "hook", "d_sae", "architecture"}}``; transcoders,
        which the engine registers beside them, are not sources here), asked of the engine once per
        request."""
        if self._registered is None:
            registered = await self.llm.list_saes()
            self.state.saes.keep_only(set(registered))
            self._registered = {name: info for name, info in registered.items() if "kind" not in info}
        return self._registered

    async def source(self, name: str, where: str) -> dict[str, Any]:
        """The registered SAE ``name`` (a Neuronpedia source id is the name it is registered under)."""
        registered = await self.saes()
        if name not in registered:
            raise NeuronpediaError(400, f"{where}: unknown source {name!r}; the registered SAEs are "
                                        f"{sorted(registered)}")
        return registered[name]

    async def sae_weights(self, name: str, where: str) -> SAE:
        """The registered SAE ``name``'s weights (and so its site and width), checked with the
        engine once per request and source."""
        if name not in self._weights:
            try:
                sae = await self.state.saes.get(self.llm, name)
            except InvalidRequestError:
                sae = None
            if not isinstance(sae, SAE):  # unknown, or a transcoder
                raise NeuronpediaError(400, f"{where}: unknown source {name!r}; the registered SAEs are "
                                            f"{sorted(await self.saes())}")
            self._weights[name] = sae
        return self._weights[name]

    def source_set(self, name: str, where: str = "source_set") -> list[str]:
        sets = self.state.source_sets
        if name not in sets:
            raise NeuronpediaError(400, f"{where}: invalid source set {name!r}; this server has {sorted(sets)} "
                                        "(--neuronpedia-source-set)")
        return sets[name]

    def site(self, hook: str, where: str) -> Site:
        """(point, layer) of a TransformerLens hook name; attention-output (``hook_z``) and every
        other non-residual hook are refused naming the hook."""
        site = transformer_lens_site(hook)
        if site is None or site[0] not in RESIDUAL_POINTS:
            why = ("an attention-output (hook_z) hook, which steerable does not serve here" if
                   hook.endswith(ATTENTION_OUTPUT) else "not a residual-stream hook")
            raise NeuronpediaError(400, f"{where}: {hook!r} is {why}; expected blocks.L.hook_resid_pre, "
                                        "blocks.L.hook_resid_mid or blocks.L.hook_resid_post")
        if not 0 <= site[1] < self.num_layers:
            raise NeuronpediaError(400, f"{where}: layer {site[1]} of {hook!r} is out of range [0, {self.num_layers})")
        return site

    # ------------------------------------------------------------ tokens

    def bos_prompt(self, text: str, where: str = "prompt") -> list[int]:
        """``text`` tokenized as the reference does: the BOS token's text prepended when the text
        does not start with it, then no special tokens added."""
        bos = self.bos()[0]
        if bos and not text.startswith(bos):
            text = bos + text
        return self.check_length(self.tokenizer.encode(text, add_special_tokens=False), where)

    def plain_prompt(self, text: str, where: str = "prompt") -> list[int]:
        """``text`` as the tokenizer encodes it by default (the reference's custom-vector path)."""
        return self.check_length(self.tokenizer.encode(text), where)

    def bos(self) -> tuple[str | None, int | None]:
        """The BOS token's text and id (None without one, or without a tokenizer: text prompts
        are then refused by ``encode``, naming the prompt)."""
        hf = self.tokenizer.hf
        return (None, None) if hf is None else (hf.bos_token, hf.bos_token_id)

    def with_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos()[1]
        return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]

    def check_length(self, ids: list[int], where: str, room: int = 1) -> list[int]:
        """At least one token, and ``room`` more within ``max_model_len``."""
        if not ids:
            raise NeuronpediaError(400, f"{where}: must contain at least one token")
        limit = self.llm.max_model_len
        if len(ids) + room > limit:
            raise NeuronpediaError(400, f"{where}: text too long: {len(ids)} tokens, max is {limit - room}")
        return ids

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.token_text(i) for i in ids]

    def special(self, ids: list[int]) -> list[bool]:
        """Whether each token is one of the tokenizer's special tokens (BOS, EOS, turn markers...)."""
        if self.state.special_ids is None:
            hf = self.tokenizer.hf
            added = getattr(hf, "added_tokens_decoder", {})
            self.state.special_ids = frozenset(hf.all_special_ids) | {i for i, t in added.items() if t.special}
        return [i in self.state.special_ids for i in ids]

    def bos_positions(self, ids: list[int]) -> list[int]:
        bos = self.bos()[1]
        return [] if bos is None else [t for t, i in enumerate(ids) if i == bos]
