"""Prompt rendering at the ingress: the model's own chat template, then token ids.

The ingress tokenizes so it can refuse over-long prompts before any engine work and so routers
can place requests by observed prompt length.

Tools: a request's tools go to the template as its `tools` argument (`with_tools`). A template
that knows `tool_calls` (its source names them) gets assistant tool calls as structured
`tool_calls` (arguments parsed from their JSON string, as vLLM's renderer does) and tool results
with their `tool_call_id`; any other template gets them as JSON text in the message's content.
`chat_template` (config `ingress.chat_template`) replaces the model's template with a file's."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from deployments.errors import bad_request
from deployments.protocol import ChatMessage


class PromptRenderer:
    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        self._tok = tokenizer
        self._vocab_size = len(tokenizer)
        self._tools: list[dict[str, Any]] | None = None
        self.structured_tool_calls = "tool_calls" in str(tokenizer.chat_template)

    @classmethod
    def from_path(cls, path: str, chat_template: str | None = None) -> PromptRenderer:
        """chat_template: a Jinja file that replaces the model's own template."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            tok.chat_template = Path(chat_template).read_text()
        return cls(tok)

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def with_tools(self, tools: list[dict[str, Any]] | None) -> PromptRenderer:
        """This renderer, rendering `tools` (OpenAI function tools) into every chat it templates."""
        if not tools:
            return self
        view = copy.copy(self)
        view._tools = tools
        return view

    def chat_tokens(self, messages: list[ChatMessage]) -> list[int]:
        return self.text_tokens(self.chat_text(self.template_messages(messages)))

    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to template messages (role, content)."""
        if self._tools:
            return self._tok.apply_chat_template(messages, tools=self._tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        return template_messages(messages, structured_tool_calls=self.structured_tool_calls)

    def turn_text(self, system: str, user: str) -> str:
        """The template's text for one more user turn (and the assistant's cue) after a system
        message: what a real-time tick appends to its session."""
        head = self.chat_text([{"role": "system", "content": system}], add_generation_prompt=False)
        full = self.chat_text([{"role": "system", "content": system}, {"role": "user", "content": user}])
        if not full.startswith(head):
            raise ValueError("the chat template does not render turns incrementally")
        return full[len(head):]

    def text_tokens(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def check_token_ids(self, ids: list[int]) -> None:
        size = self._vocab_size
        bad = next((i for i in ids if i < 0 or i >= size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {size})", param="prompt")


def template_messages(messages: list[ChatMessage], structured_tool_calls: bool = False) -> list[dict[str, Any]]:
    return [_as_template_message(m, structured_tool_calls) for m in messages]


def _as_template_message(m: ChatMessage, structured: bool) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    content = m.text()
    if structured:
        out: dict[str, Any] = {"role": role, "content": content}
        if m.role == "assistant" and m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.role == "tool" and m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out
    if m.role == "assistant" and m.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        content = (content + "\n" if content else "") + json.dumps(calls)
    return {"role": role, "content": content}


def _arguments(text: str) -> Any:
    """A call's arguments as the template takes them: the JSON object, or the text as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
