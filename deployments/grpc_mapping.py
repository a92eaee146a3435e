"""baton.v1 messages <-> the OpenAI objects the HTTP API speaks, both directions.

Server: `chat_body(ChatRequest)` is the chat-completions body (a dict) that
`ChatCompletionRequest` then validates exactly as over HTTP; `response_message` and
`chunk_message` turn the frontend's OpenAI reply and chunk objects into ChatResponse/ChatChunk.
Completions alike: `completion_body`, `completion_message`, `completion_chunk_message`.
Client (`baton replay --protocol grpc`, tests): `chat_request(body)` builds a ChatRequest from an
HTTP body (`completion_request` a CompletionRequest), and `chunk_event` turns a ChatChunk back
into the SSE event it stands for.
Unset optional fields stay absent from the body, so the server's defaults apply as over HTTP.
"""
from __future__ import annotations

import json
from typing import Any

from deployments.errors import APIError, bad_request
from deployments.grpc_gen import baton_pb2 as pb
from deployments.request_body import InvalidJSON, decode_json

_OPTIONAL = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
             "user", "session_id", "parallel_tool_calls")


def chat_body(req: pb.ChatRequest, stream: bool) -> dict[str, Any]:
    body = {"messages": [_message(m) for m in req.messages], **_sampling_body(req, _OPTIONAL, stream)}
    if req.HasField("memories"):
        m = req.memories
        body["memories"] = {k: getattr(m, k) for k in ("k", "mode", "window") if m.HasField(k)} | ({"ids": list(m.ids)} if m.ids else {})
    if req.tools_json:
        body["tools"] = _json(req.tools_json, "tools_json")
    if req.tool_choice_json:
        body["tool_choice"] = _json(req.tool_choice_json, "tool_choice_json")
    return body


_COMPLETION_OPTIONAL = tuple(f for f in _OPTIONAL if f != "parallel_tool_calls")


def _sampling_body(req: Any, optional: tuple[str, ...], stream: bool) -> dict[str, Any]:
    """The body fields ChatRequest and CompletionRequest share: the set optional ones, stop,
    ignore_eos, and stream_options when a stream asks for usage (last, or on every chunk too)."""
    body: dict[str, Any] = {"stream": stream, **{f: getattr(req, f) for f in optional if req.HasField(f)}}
    if req.stop:
        body["stop"] = list(req.stop)
    if req.ignore_eos:
        body["ignore_eos"] = True
    opts = {f: True for f in ("include_usage", "continuous_usage_stats") if getattr(req, f)}
    if stream and opts:
        body["stream_options"] = opts
    return body


def completion_body(req: pb.CompletionRequest, stream: bool) -> dict[str, Any]:
    """The completions body; the prompt is the text or the token ids (a missing one: absent, so
    the body's validation answers it as over HTTP)."""
    body = _sampling_body(req, _COMPLETION_OPTIONAL, stream)
    kind = req.WhichOneof("prompt")
    if kind == "text":
        body["prompt"] = req.text
    elif kind == "token_ids":
        body["prompt"] = list(req.token_ids.ids)
    return body


def _message(m: pb.Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content if m.HasField("content") else None}
    for f in ("name", "tool_call_id"):
        if m.HasField(f):
            out[f] = getattr(m, f)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or None, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    return out


def _json(text: str, field: str) -> Any:
    try:
        return decode_json(text)
    except InvalidJSON as e:
        raise bad_request(f"{field} is not valid JSON: {e}", param=field, code="invalid_json") from None


def _usage(use: dict[str, Any] | None) -> pb.Usage | None:
    if not use:
        return None
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return pb.Usage(prompt_tokens=use["prompt_tokens"], completion_tokens=use["completion_tokens"], total_tokens=use["total_tokens"],
                    cached_tokens=cached)


def response_message(body: dict[str, Any], replica: str | None, session_id: str | None) -> pb.ChatResponse:
    """An OpenAI chat.completion object as a ChatResponse."""
    choice = body["choices"][0]
    msg = choice["message"]
    calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in msg.get("tool_calls") or ()]
    out = pb.ChatResponse(id=body["id"], model=body["model"], tool_calls=calls, finish_reason=choice.get("finish_reason") or "",
                          usage=_usage(body.get("usage")), replica=replica or "", session_id=session_id or "")
    if msg.get("content") is not None:
        out.content = msg["content"]
    return out


def chunk_message(chunk: dict[str, Any], replica: str | None = None) -> pb.ChatChunk:
    """An OpenAI chat.completion.chunk object as a ChatChunk (`replica`: set on the first)."""
    out = pb.ChatChunk(id=chunk["id"], model=chunk["model"], usage=_usage(chunk.get("usage")), replica=replica or "")
    for choice in chunk["choices"][:1]:
        delta = choice.get("delta") or {}
        out.role = delta.get("role") or ""
        out.content = delta.get("content") or ""
        out.finish_reason = choice.get("finish_reason") or ""
        for c in delta.get("tool_calls") or ():
            fn = c.get("function") or {}
            out.tool_calls.append(pb.ToolCallDelta(index=c["index"], id=c.get("id") or "", name=fn.get("name") or "",
                                                   arguments=fn.get("arguments") or ""))
    return out


def completion_message(body: dict[str, Any], replica: str | None, session_id: str | None) -> pb.CompletionResponse:
    """An OpenAI text_completion object as a CompletionResponse."""
    choice = body["choices"][0]
    return pb.CompletionResponse(id=body["id"], model=body["model"], text=choice.get("text") or "", finish_reason=choice.get("finish_reason") or "",
                                 usage=_usage(body.get("usage")), replica=replica or "", session_id=session_id or "")


def completion_chunk_message(chunk: dict[str, Any], replica: str | None = None) -> pb.CompletionChunk:
    """A streamed text_completion chunk as a CompletionChunk (`replica`: set on the first)."""
    out = pb.CompletionChunk(id=chunk["id"], model=chunk["model"], usage=_usage(chunk.get("usage")), replica=replica or "")
    for choice in chunk["choices"][:1]:
        out.text = choice.get("text") or ""
        out.finish_reason = choice.get("finish_reason") or ""
    return out


def models_message(models: dict[str, Any]) -> pb.ListModelsResponse:
    return pb.ListModelsResponse(models=[pb.Model(id=m["id"], owned_by=m.get("owned_by", ""), max_model_len=m.get("max_model_len", 0))
                                         for m in models["data"]])


def error_message(e: APIError) -> pb.Error:
    return pb.Error(message=e.message, type=e.type, param=e.param or "", code=e.code or "")


# ---- client side --------------------------------------------------------------------------------


def chat_request(body: dict[str, Any]) -> pb.ChatRequest:
    """The ChatRequest for an HTTP chat-completions body (fields the proto does not carry are
    dropped; `stream` is the RPC's choice)."""
    req = _with_sampling(pb.ChatRequest(messages=[_message_proto(m) for m in body["messages"]]), body, _OPTIONAL)
    if body.get("memories") is not None:
        m = body["memories"]
        req.memories.CopyFrom(pb.Memories(ids=m.get("ids") or [], **{k: m[k] for k in ("k", "mode", "window") if m.get(k) is not None}))
    if body.get("tools") is not None:
        req.tools_json = json.dumps(body["tools"])
    if body.get("tool_choice") is not None:
        req.tool_choice_json = json.dumps(body["tool_choice"])
    return req


def _with_sampling(req: Any, body: dict[str, Any], optional: tuple[str, ...]) -> Any:
    """`req` with the body fields ChatRequest and CompletionRequest share (the inverse of _sampling_body)."""
    for f in optional:
        if body.get(f) is not None:
            setattr(req, f, body[f])
    stop = body.get("stop")
    req.stop.extend([stop] if isinstance(stop, str) else stop or [])
    req.ignore_eos = bool(body.get("ignore_eos"))
    opts = body.get("stream_options") or {}
    req.include_usage = bool(opts.get("include_usage"))
    req.continuous_usage_stats = bool(opts.get("continuous_usage_stats"))
    return req


def completion_request(body: dict[str, Any]) -> pb.CompletionRequest:
    """The CompletionRequest for an HTTP completions body (text, token ids, or a one-text list)."""
    req = _with_sampling(pb.CompletionRequest(), body, _COMPLETION_OPTIONAL)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0] if len(prompt) == 1 else prompt
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list):
        req.token_ids.CopyFrom(pb.TokenIds(ids=prompt))
    return req


def _message_proto(m: dict[str, Any]) -> pb.Message:
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content)
    out = pb.Message(role=m["role"], name=m.get("name"), tool_call_id=m.get("tool_call_id"))
    if content is not None:
        out.content = content
    for c in m.get("tool_calls") or ():
        out.tool_calls.append(pb.ToolCall(id=c.get("id") or "", name=c["function"]["name"], arguments=c["function"].get("arguments", "")))
    return out


def chunk_event(chunk: pb.ChatChunk) -> dict[str, Any]:
    """The OpenAI chunk (or {"error": ...} event) a ChatChunk stands for."""
    if chunk.HasField("error"):
        e = chunk.error
        return {"error": {"message": e.message, "type": e.type, "param": e.param or None, "code": e.code or None}}
    out: dict[str, Any] = {"id": chunk.id, "object": "chat.completion.chunk", "model": chunk.model, "choices": []}
    delta: dict[str, Any] = {}
    if chunk.role:
        delta["role"] = chunk.role
    if chunk.content or chunk.role:
        delta["content"] = chunk.content
    if chunk.tool_calls:
        delta["tool_calls"] = [{"index": c.index, **({"id": c.id, "type": "function"} if c.id else {}),
                                "function": {k: v for k, v in (("name", c.name), ("arguments", c.arguments)) if v}} for c in chunk.tool_calls]
    if delta or chunk.finish_reason:
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": chunk.finish_reason or None}]
    if chunk.HasField("usage"):
        u = chunk.usage
        out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
                        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    return out
