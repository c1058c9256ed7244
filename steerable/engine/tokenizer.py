"""Tokenization, chat templates and incremental detokenization, all delegated to HF tokenizers."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class Tokenizer:
    """Thin wrapper over a transformers tokenizer; ``None`` inside means token-id prompts only."""

    def __init__(self, hf_tokenizer: Any | None):
        self.hf = hf_tokenizer
        self._token_texts: dict[int, str] = {}

    @property
    def available(self) -> bool:
        return self.hf is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._require("a text prompt")
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        self._require("chat")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return ""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone with special tokens kept (the text of a logprob entry), memoised:
        ``logprobs=-1`` names every vocabulary entry at every position."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], False)
        return text

    def stream(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    def _require(self, what: str) -> None:
        if self.hf is None:
            raise ValueError(f"prompt: this model has no tokenizer, so {what} is not possible; pass token ids")


class IncrementalDetokenizer:
    """New text per generated token in O(1) amortised time (tokenizers' DecodeStream), primed with
    the prompt tail so the first generated pieces join the prompt as a full decode would (a leading
    space stays a space)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.backend = tokenizer.hf.backend_tokenizer if tokenizer.available else None
        self.text = ""
        if self.backend is not None:
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token in prompt_token_ids[-_PRIME_TOKENS:]:
                self.stream.step(self.backend, token)

    def step(self, token_id: int) -> str:
        """Append one token; returns the text it added ('' while a multi-byte character is pending)."""
        if self.backend is None:
            return ""
        piece = self.stream.step(self.backend, token_id) or ""
        self.text += piece
        return piece


_PRIME_TOKENS = 6
