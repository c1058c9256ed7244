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
from steerable.outputs import CompletionOutput, Logprob, RequestOutput

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
    prompt_fields_on_choice = False
    body: ChatCompletionRequest

    def tokenized_prompts(self) -> list[list[int]]:
        body = self.body
        kwargs = {**(body.chat_template_kwargs or {}), "continue_final_message": body.continue_final_message}
        if body.tools is not None:  # the template decides how the model sees them
            kwargs["tools"] = body.tools
        return [apply_template(self.state, body.messages, body.add_generation_prompt, kwargs)]

    def echoed(self) -> str:
        """``echo``: the last message's content prepended to each choice, when it is the assistant's."""
        last = self.body.messages[-1] if self.body.echo and self.body.messages else {}
        return _message(last, len(self.body.messages) - 1)["content"] if last.get("role") == "assistant" else ""

    def requested_max_tokens(self) -> int | None:
        body = self.body
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.state.llm.max_model_len - prompt_len

    def logprobs(self) -> int | None:
        return self.body.chat_logprobs()

    def choice(self, index: int, completion: CompletionOutput, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": self.echoed() + completion.text},
                "logprobs": self._logprobs(completion, 0)}

    def delta(self, index: int, text: str, completion: CompletionOutput, start: int,
              out: RequestOutput) -> dict[str, Any]:
        if start == 0:
            text = self.echoed() + text
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(completion, start), "finish_reason": None}

    def _logprobs(self, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
        """OpenAI's chat format for tokens from ``start`` with the ``top_logprobs`` most likely alternatives."""
        if completion.logprobs is None or start >= len(completion.token_ids):
            return None
        top = self.body.top_logprobs or 0

        def entry(token: int, lp: Logprob) -> dict[str, Any]:
            name = self.token_name(token, lp)
            return {"token": name, "logprob": lp.logprob, "bytes": list(name.encode())}

        tokens = token_logprobs(completion.token_ids[start:], completion.logprobs[start:])
        return {"content": [{**entry(token, sampled),
                             "top_logprobs": [entry(t, lp) for t, lp in ranked if lp.rank <= top]}
                            for token, sampled, ranked in tokens]}

    def opening(self) -> list[list[dict[str, Any]]]:
        return [[{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] for k in range(self.body.n)]
