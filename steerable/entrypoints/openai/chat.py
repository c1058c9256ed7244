"""``POST /v1/chat/completions``: the conversation goes through the tokenizer's chat template (or
``--chat-template``); each choice's first stream chunk carries the assistant role."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from steerable.entrypoints.openai.auth import require_user
from steerable.entrypoints.openai.chat_message import AssistantStream, AssistantText
from steerable.entrypoints.openai.protocol import ChatCompletionRequest
from steerable.entrypoints.openai.reasoning import REASONING_PARSERS
from steerable.entrypoints.openai.serving import Generation, token_logprobs
from steerable.entrypoints.openai.state import ServerState, server_state
from steerable.entrypoints.openai.tools import tool_parser
from steerable.errors import InvalidRequestError
from steerable.outputs import CompletionOutput, Logprob, RequestOutput

router = APIRouter(dependencies=[Depends(require_user)])

PROMPT_TAIL_TOKENS = 16  # the end of a prompt, read for whether the template already closed its thinking


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
    out = {**message, "content": content or ""}
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _template_calls(message["tool_calls"], f"messages[{i}].tool_calls")
    return out


def _template_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls as chat templates read them: OpenAI sends ``arguments`` as a JSON
    string, templates (Qwen's, Llama's) write them out as objects (vLLM converts them too)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}: expected a list")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f'{where}[{k}]: expected {{"id", "type": "function", "function": '
                                      '{"name", "arguments"}}')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequestError(f"{where}[{k}].function.arguments: not valid JSON") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


class Chat(Generation):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_fields_on_choice = False
    body: ChatCompletionRequest
    assistant: AssistantText

    def tokenized_prompts(self) -> list[list[int]]:
        body = self.body
        settings = self.state.settings
        tools, constraint = tool_parser(body.tools, body.tool_choice, settings.tool_call_parser)
        if constraint is not None:  # required or named: the tools' schemas hold the output
            if body._structured is not None:
                raise InvalidRequestError(f"tool_choice: a forced tool call cannot be combined with "
                                          f"{body._structured.field_name}")
            body._structured = constraint
        if tools is not None and not tools.skip_special_tokens:
            body.skip_special_tokens = False  # the call markers are special tokens
        kwargs = {**(body.chat_template_kwargs or {}), "continue_final_message": body.continue_final_message}
        if body.tools is not None:  # the template decides how the model sees them
            kwargs["tools"] = body.tools
        prompt = apply_template(self.state, body.messages, body.add_generation_prompt, kwargs)
        reasoning = None
        if settings.reasoning_parser is not None and constraint is None:  # a forced call's grammar is JSON only
            tail = self.state.llm.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            reasoning = REASONING_PARSERS[settings.reasoning_parser](tail, body.chat_template_kwargs,
                                                                     needs_start=body._structured is not None)
        self.assistant = AssistantText(reasoning, tools, body.include_reasoning, forced=constraint is not None)
        self.streams: dict[int, AssistantStream] = {}
        self.called: set[int] = set()  # choices whose message calls tools
        return [prompt]

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
        message, called = self.assistant.message(completion.text, self.echoed())
        if called:
            self.called.add(index)
        return {"index": index, "message": message, "logprobs": self._logprobs(completion, 0)}

    def delta(self, index: int, text: str, completion: CompletionOutput, start: int, out: RequestOutput,
              may_skip: bool) -> dict[str, Any] | None:
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = self.assistant.stream()
            text = self.echoed() + text
        fields = stream.feed(text, final=completion.finish_reason is not None)
        if stream.called:
            self.called.add(index)
        if not fields and may_skip:
            return None
        # vLLM's chunks always carry some delta; one with nothing new says so with empty content.
        return {"index": index, "delta": fields or {"content": ""}, "logprobs": self._logprobs(completion, start),
                "finish_reason": None}

    def finish_reason(self, index: int, completion: CompletionOutput) -> str | None:
        """``tool_calls`` where the message calls tools and the model ended it (not a length cut)."""
        reason = completion.finish_reason
        return "tool_calls" if reason == "stop" and index in self.called else reason

    def _logprobs(self, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
        """OpenAI's chat format for tokens from ``start`` with the ``top_logprobs`` most likely
        alternatives, vLLM's order: the token itself first, then the others by rank."""
        if completion.logprobs is None or start >= len(completion.token_ids):
            return None
        top = self.body.top_logprobs or 0

        def entry(token: int, lp: Logprob) -> dict[str, Any]:
            name = self.token_name(token, lp)
            return {"token": name, "logprob": lp.logprob, "bytes": list(name.encode())}

        tokens = token_logprobs(completion.token_ids[start:], completion.logprobs[start:], top)
        return {"content": [{**entry(token, sampled), "top_logprobs": [entry(t, lp) for t, lp in ranked[:top]]}
                            for token, sampled, ranked in tokens]}

    def opening(self) -> list[list[dict[str, Any]]]:
        return [[{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] for k in range(self.body.n)]

    def opening_fields(self) -> dict[str, Any]:
        """vLLM sends the prompt's token ids on the opening chunks, at the top level."""
        return {"prompt_token_ids": self.prompts[0]} if self.body.return_token_ids else {}
