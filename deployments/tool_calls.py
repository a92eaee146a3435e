"""Tool calling at the ingress, with vLLM's own parsers (vllm/tool_parsers, composed by
vllm/parser's ParserManager): which parser a model uses is config (`ingress.tool_call_parser`).

  ToolCalling.plan(body)    per request, before rendering: the tools for the template, the
                            guided-decoding constraint vLLM's parser asks for (tool_choice
                            "required" or a named function), and whether to parse the reply;
                            400 when the model has no parser configured
  ToolCalling.reply(plan)   per request: a ToolReply that parses the reply text into tool calls,
                            whole (`complete`) or as OpenAI-style stream deltas (`feed`)

A reply the parser cannot read (a malformed call) is returned as text, never a 5xx. vLLM is
imported only by an ingress that has a parser configured."""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.engine.types import GenerationDelta, OutputConstraint
from deployments.errors import bad_request
from deployments.protocol import ChatCompletionRequest
from deployments.tool_schema import check_tool_request, template_tools

logger = logging.getLogger("baton.api")

Piece = tuple[dict[str, Any], str | None]  # one stream chunk: (delta, finish_reason)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply: its text (None when it is only calls), its calls and its finish reason."""

    content: str | None
    calls: tuple[ParsedCall, ...]
    finish_reason: str | None


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request asks of tool calling (built by ToolCalling.plan)."""

    template_tools: list[dict[str, Any]]  # the chat template's `tools` argument
    constraint: OutputConstraint | None  # guided decoding for required / named tool_choice
    parse: bool  # False for tool_choice "none": the reply is plain text
    single_call: bool  # parallel_tool_calls false: the first call only
    skip_special_tokens: bool  # what the parser asks of detokenization (hermes: keep tags that are special tokens)
    vllm_request: Any  # vLLM's ChatCompletionRequest, as its parsers read requests


def finish_reason_with_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when a reply that ended by itself called tools."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ToolCalling:
    """One model's tool calling: vLLM's parser `parser_name` over the ingress's tokenizer (None: off)."""

    def __init__(self, parser_name: str | None = None, tokenizer: Any = None, model_id: str = "baton"):
        self.parser_name = parser_name
        self._tok = tokenizer
        self._model_id = model_id
        self._parser_cls: Any = None
        if parser_name is not None:
            from vllm.parser.parser_manager import ParserManager

            self._parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True, tokenizer=tokenizer)

    @property
    def enabled(self) -> bool:
        return self._parser_cls is not None

    def plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        """None for a request without tools; 400 for tools this model cannot serve."""
        check_tool_request(body.tools, body.tool_choice)
        tools = template_tools(body.tools)
        if tools is None:
            return None
        if self._parser_cls is None:
            raise bad_request("tool calling is not enabled for this model (its config sets no ingress.tool_call_parser)",
                              param="tools", code="tools_unavailable")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest

        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else (body.tool_choice or "auto")
        try:
            vreq = VllmChatRequest(messages=[], model=self._model_id, tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls)
            vreq = self._parser_cls(self._tok, vreq.tools).adjust_request(vreq)
        except ValueError as e:  # pydantic's ValidationError and vLLM's VLLMValidationError are ValueErrors
            raise bad_request(f"invalid tools: {e}", param="tools", code="invalid_value") from None
        return ToolPlan(template_tools=tools, constraint=_constraint(vreq.structured_outputs), parse=choice != "none",
                        single_call=body.parallel_tool_calls is False, skip_special_tokens=vreq.skip_special_tokens, vllm_request=vreq)

    def reply(self, plan: ToolPlan | None, prompt_token_ids: Sequence[int] = ()) -> ToolReply | None:
        """The parser for one reply (parsers keep streaming state: one per request); None: plain text."""
        if plan is None or not plan.parse or self._parser_cls is None:
            return None
        return ToolReply(self._parser_cls(self._tok, plan.vllm_request.tools), plan, list(prompt_token_ids))


def _constraint(structured: Any) -> OutputConstraint | None:
    if structured is None:
        return None
    if structured.structural_tag is not None:
        return OutputConstraint(structural_tag=structured.structural_tag)
    if structured.json is not None:
        schema = structured.json
        return OutputConstraint(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
    return None


class ToolReply:
    """Parses one reply. `complete(text)`: the whole reply. `feed(delta)`: the stream's chunks for
    each engine delta; at the last delta it checks the streamed calls against a parse of the
    whole text, sends what the streaming parser held back (text of a malformed call, argument
    tails) and the finish chunk. Invariant: the chunks reassemble to `complete(text)`'s content,
    call names and arguments (ids are minted per call, so they differ between the two)."""

    def __init__(self, parser: Any, plan: ToolPlan, prompt_token_ids: list[int]):
        self._parser, self._plan, self._prompt = parser, plan, prompt_token_ids
        self._text: list[str] = []
        self._sent_content = ""
        self._sent_calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]
        self._broken = False  # the streaming parser raised: the rest goes out as text

    def complete(self, text: str, finish_reason: str | None) -> ParsedReply:
        try:
            _, content, calls = self._parser.parse(text, self._plan.vllm_request, enable_auto_tools=True)
        except Exception:  # noqa: BLE001 - a reply the parser cannot read is text, not a 5xx
            logger.warning("the tool parser failed on a reply; it is returned as text")
            return ParsedReply(text, (), finish_reason)
        parsed = tuple(ParsedCall(c.id or _call_id(), c.name, c.arguments) for c in calls or ())
        if self._plan.single_call:
            parsed = parsed[:1]
        if not parsed:
            return ParsedReply(content if content is not None else text, (), finish_reason)
        return ParsedReply(content or None, parsed, finish_reason_with_calls(finish_reason, True))

    def feed(self, d: GenerationDelta) -> list[Piece]:
        self._text.append(d.text)
        pieces: list[Piece] = []
        if not self._broken and (d.text or d.finished):
            try:
                msg = self._parser.parse_delta(d.text, list(d.token_ids), self._plan.vllm_request, self._prompt, finished=d.finished)
            except Exception:  # noqa: BLE001 - fall back to text for the rest of the reply
                logger.warning("the streaming tool parser failed; the rest of the reply is sent as text")
                self._broken = True
                msg = None
                if d.text:
                    pieces.append(self._content(d.text))
            if msg is not None:
                pieces.extend(self._pieces(msg))
        elif self._broken and d.text:
            pieces.append(self._content(d.text))
        if d.finished:
            pieces.extend(self._finish(d.finish_reason))
        return pieces

    def _pieces(self, msg: Any) -> list[Piece]:
        out: list[Piece] = []
        if msg.content:
            out.append(self._content(msg.content))
        for tc in msg.tool_calls or ():
            if self._plan.single_call and tc.index > 0:
                continue
            fn = tc.function
            name, args = (fn.name, fn.arguments) if fn is not None else (None, None)
            sent = self._sent_calls.setdefault(tc.index, [tc.id or _call_id(), "", ""])
            if name:
                sent[1] = name
            sent[2] += args or ""
            delta: dict[str, Any] = {"index": tc.index}
            if tc.id is not None or name:
                delta.update(id=sent[0], type="function")
            delta["function"] = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
            out.append(({"tool_calls": [delta]}, None))
        return out

    def _content(self, text: str) -> Piece:
        self._sent_content += text
        return {"content": text}, None

    def _finish(self, finish_reason: str | None) -> list[Piece]:
        whole = self.complete("".join(self._text), finish_reason)
        out: list[Piece] = []
        if not self._sent_calls:
            text = whole.content or ""
            if whole.calls:  # the streaming parser missed calls the whole parse found: send them whole
                out.extend(({"tool_calls": [{"index": i, **c.as_openai()}]}, None) for i, c in enumerate(whole.calls))
            elif text.startswith(self._sent_content) and len(text) > len(self._sent_content):
                out.append(self._content(text[len(self._sent_content):]))  # e.g. the text of a malformed call
        else:
            for i, c in enumerate(whole.calls):
                sent = self._sent_calls.get(i)
                if sent is not None and c.arguments.startswith(sent[2]) and len(c.arguments) > len(sent[2]):
                    out.append(({"tool_calls": [{"index": i, "function": {"arguments": c.arguments[len(sent[2]):]}}]}, None))
                    sent[2] = c.arguments
        return [*out, ({}, finish_reason_with_calls(finish_reason, bool(self._sent_calls) or bool(whole.calls)))]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
