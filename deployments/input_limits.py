"""Bounds on what one request may ask the ingress to do, checked before any templating or
tokenization (pure functions over parsed bodies; deployments/request_body.py bounds the bytes).

A prompt's characters are counted before it is tokenized: a prompt longer than
`max_prompt_chars` is refused with the context-length error without spending CPU on it (the
default, CHARS_PER_TOKEN_BOUND characters per token of context, is far beyond what any real
tokenizer fits in the context). Token-id prompts are refused past the context length before their
ids are checked against the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

from deployments.errors import bad_request
from deployments.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from deployments.tool_schema import check_tool_request, tools_chars

DEFAULT_MAX_BODY_BYTES = 4 << 20
CHARS_PER_TOKEN_BOUND = 32  # 4× a generous 8 characters per token


@dataclass(frozen=True)
class InputLimits:
    """One ingress's bounds (config: ingress.max_body_bytes, max_messages, max_prompt_chars,
    render_threads). max_prompt_chars None: CHARS_PER_TOKEN_BOUND × the context length."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = 1024
    max_prompt_chars: int | None = None
    render_threads: int = 2  # prompts templated/tokenized at once, off the event loop

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN_BOUND * max_model_len


def chat_chars(messages: list[ChatMessage]) -> int:
    """Characters the chat template will render from the client (text, names, tool calls)."""
    n = 0
    for m in messages:
        n += len(m.text()) + len(m.name or "") + len(m.tool_call_id or "")
        for c in m.tool_calls or ():
            n += len(c.function.name) + len(c.function.arguments) + len(c.id or "")
    return n


def check_input(body: ChatCompletionRequest | CompletionRequest, limits: InputLimits, max_model_len: int) -> None:
    """400 for a request over the bounds; nothing is rendered or tokenized yet."""
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > limits.max_messages:
            raise bad_request(f"at most {limits.max_messages} messages per request (got {len(body.messages)})",
                              param="messages", code="too_many_messages")
        check_tool_request(body.tools, body.tool_choice)
        _check_chars(chat_chars(body.messages) + tools_chars(body.tools), limits.prompt_chars(max_model_len), "messages")
        return
    prompt = body.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        text = prompt if isinstance(prompt, str) else prompt[0]
        _check_chars(len(text), limits.prompt_chars(max_model_len), "prompt")  # type: ignore[arg-type]
    elif len(prompt) >= max_model_len:
        raise bad_request(f"the prompt has {len(prompt)} token ids; this model's context length is {max_model_len}",
                          param="prompt", code="context_length_exceeded")


def _check_chars(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise bad_request(f"the prompt has {n} characters; at most {limit} are accepted before tokenization",
                          param=param, code="context_length_exceeded")
