"""Prompt rendering at the ingress: the model's own chat template, then token ids.

The ingress tokenizes so it can refuse over-long prompts before any engine work and so routers
can place requests by observed prompt length.

Tools: a request's tools go to the template as its `tools` argument (`with_tools`). A template
that knows `tool_calls` (its source names them) gets assistant tool calls as structured
`tool_calls` (arguments parsed from their JSON string, as vLLM's renderer does) and tool results
with their `tool_call_id`; any other template gets them as JSON text in the message's content.
`chat_template` (config `ingress.chat_template`) replaces the model's template with a file's.

`incremental` (config `ingress.incremental_tokenization`): a conversation's turn tokenizes only
what its rendering appended to the previous turn's (deployments/token_prefix.py), keyed by the
caller (the frontend: user and session id), after a probe on this tokenizer and template said
the result equals whole tokenization; otherwise every prompt is tokenized whole."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from deployments.errors import bad_request
from deployments.protocol import ChatMessage
from deployments.token_prefix import PrefixTokens, probe

logger = logging.getLogger("ray.serve")

# successive renderings of this conversation check incremental tokenization against whole
_PROBE = [{"role": "system", "content": "You help.  Tools: {\"f\": [1, 2]}\n"}, {"role": "user", "content": " Hi,\tthere!! 123 4567 ümlaut 数字"},
          {"role": "assistant", "content": "Sure:\n\n  - one\n- two "}, {"role": "user", "content": "and  then?\n"},
          {"role": "assistant", "content": "<tool>{\"x\": 1}</tool>"}, {"role": "user", "content": "ok."}]


class PromptRenderer:
    def __init__(self, tokenizer: Any, incremental: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        self._tok = tokenizer
        self._vocab_size = len(tokenizer)
        self._tools: list[dict[str, Any]] | None = None
        self.structured_tool_calls = "tool_calls" in str(tokenizer.chat_template)
        self._prefix = self._prefix_tokens() if incremental else None

    @classmethod
    def from_path(cls, path: str, chat_template: str | None = None, incremental: bool = False) -> PromptRenderer:
        """chat_template: a Jinja file that replaces the model's own template."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            tok.chat_template = Path(chat_template).read_text()
        return cls(tok, incremental)

    def _prefix_tokens(self) -> PrefixTokens | None:
        decoder = getattr(self._tok, "added_tokens_decoder", {})
        special = {t.content: i for i, t in decoder.items() if getattr(t, "special", False) and t.content}
        try:  # a template that cannot render the probe (e.g. one refusing a system message) means no cache, not a failed start
            turns = [self.chat_text(self.template_messages([ChatMessage.model_validate(m) for m in _PROBE[:k]])) for k in (2, 4, 6)]
            ok = bool(special) and probe(self.text_tokens, special, turns)
        except Exception as e:  # noqa: BLE001 - any failure of the probe turns the cache off
            logger.warning("incremental tokenization is off: its probe failed (%s)", type(e).__name__)
            return None
        if not ok:
            logger.warning("incremental tokenization is off: on this tokenizer and template it does not reproduce whole tokenization")
            return None
        return PrefixTokens(self.text_tokens, special)

    @property
    def incremental(self) -> bool:
        return self._prefix is not None

    def prefix_snapshot(self) -> dict[str, int] | None:
        return self._prefix.snapshot() if self._prefix is not None else None

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

    def chat_tokens(self, messages: list[ChatMessage], key: str | None = None) -> list[int]:
        """key: the conversation the messages belong to (None: tokenized whole)."""
        text = self.chat_text(self.template_messages(messages))
        return self._prefix.tokens(key, text) if self._prefix is not None else self.text_tokens(text)

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
