"""Prompt rendering at the ingress: the model's own chat template, then token ids.

The ingress tokenizes so it can refuse over-long prompts before any engine work and so routers
can place requests by observed prompt length."""
from __future__ import annotations

import json
from typing import Any

from deployments.errors import bad_request
from deployments.protocol import ChatMessage


class PromptRenderer:
    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        self._tok = tokenizer
        self._vocab_size = len(tokenizer)

    @classmethod
    def from_path(cls, path: str) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def chat_tokens(self, messages: list[ChatMessage]) -> list[int]:
        return self.text_tokens(self.chat_text(template_messages(messages)))

    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to template messages (role, content)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

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


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [_as_template_message(m) for m in messages]


def _as_template_message(m: ChatMessage) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    content = m.text()
    if m.role == "assistant" and m.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        content = (content + "\n" if content else "") + json.dumps(calls)
    return {"role": role, "content": content}
