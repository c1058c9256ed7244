"""The server's caps on one request, checked before it is queued (docs/server.md, "Limits"): a
request the engine could never hold is refused with a 400 naming the field at once, rather than
queued while it blocks everyone behind it. ``n`` itself is capped by the engine (``--max-n``)."""

from __future__ import annotations

from steerable.errors import InvalidRequestError


def check_kv_fit(n: int, prompt_len: int, max_tokens: int | None, kv_capacity: int) -> None:
    """``n`` completions of a ``prompt_len``-token prompt, and ``n`` x ``max_tokens`` when the
    client set it, must each fit the KV cache's ``kv_capacity`` tokens (the engine runs the
    completions as room allows, but a request larger than the whole cache is refused)."""
    if n * prompt_len > kv_capacity:
        raise InvalidRequestError(f"n: {n} completions of a {prompt_len}-token prompt need {n * prompt_len} tokens of "
                                  f"KV cache, more than its {kv_capacity}; lower n or shorten the prompt")
    if max_tokens is not None and n * max_tokens > kv_capacity:
        raise InvalidRequestError(f"max_tokens: {n} completions of up to {max_tokens} tokens need {n * max_tokens} "
                                  f"tokens of KV cache, more than its {kv_capacity}; lower n or max_tokens")
