"""``POST /v1/chat/completions``: the conversation goes through the tokenizer's chat template (or
``--chat-template``); each choice's first stream chunk carries the assistant role."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from steerable.entrypoints.openai.auth import require_user
from steerable.entrypoints.openai.protocol import ChatCompletionRequest
from steerable.entrypoints.openai.serving import Generation, token_logprobs
from steerable.entrypoints.openai.state import ServerState, server_state
from steerable.errors import InvalidRequestError
from steerable.outputs import CompletionOutput

router = APIRouter(dependencies=[Depends(require_user)])


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await Chat(server_state(request), body, request).respond()


def apply_template(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation; a 400 naming the field when there is no template or it fails."""
    tokenizer = state.llm.tokenizer
    template = state.settings.chat_template
    if tokenizer.hf is None or (template is None and not getattr(tokenizer.hf, "chat_template", None)):
        raise InvalidRequestError("messages: this model's tokenizer has no chat template; start the server with "
                                  "--chat-template, or use /v1/completions")
    conversation = [_message(m, i) for i, m in enumerate(messages)]
    if not conversation:
        raise InvalidRequestError("messages: at least one message is required")
    extra = dict(kwargs or {})
    if template is not None:
        extra["chat_template"] = template
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt, **extra)
    except Exception as err:  # a Jinja error, or a template that raises on this conversation
        raise InvalidRequestError(f"messages: the chat template failed: {err}") from None


def _message(message: dict[str, Any], i: int) -> dict[str, Any]:
    """A message with text content (OpenAI's list of text parts joined)."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequestError(f"messages[{i}].role: expected a string")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequestError(f"messages[{i}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise InvalidRequestError(f"messages[{i}].content: expected a string or a list of text parts")
    return {**message, "content": content or ""}


class Chat(Generation):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest

    def tokenized_prompts(self) -> list[list[int]]:
        body = self.body
        return [apply_template(self.state, body.messages, body.add_generation_prompt, body.chat_template_kwargs)]

    def requested_max_tokens(self) -> int | None:
        body = self.body
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.state.llm.max_model_len - prompt_len

    def logprobs(self) -> int | None:
        return self.body.chat_logprobs()

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": _logprobs(completion, 0, len(completion.token_ids), self.body.top_logprobs or 0)}

    def delta(self, index: int, text: str, completion: CompletionOutput, start: int) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": _logprobs(completion, start, len(completion.token_ids), self.body.top_logprobs or 0),
                "finish_reason": None}

    def opening(self) -> list[list[dict[str, Any]]]:
        return [[{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] for k in range(self.body.n)]


def _logprobs(completion: CompletionOutput, start: int, end: int, top: int) -> dict[str, Any] | None:
    """OpenAI's chat format for tokens ``start:end`` with the ``top`` most likely alternatives."""
    if completion.logprobs is None or start >= end:
        return None

    def entry(lp: Any) -> dict[str, Any]:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(sampled), "top_logprobs": [entry(lp) for lp in ranked if lp.rank <= top]}
                        for sampled, ranked in token_logprobs(completion, start, end)]}
