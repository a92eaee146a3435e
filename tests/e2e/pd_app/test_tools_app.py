"""Tool calling end to end: Ray + Serve + real vLLM engines (SmolLM2, the local YAML's hermes
parser and tools template), spoken to with the official `openai` client.

A forced tool_choice makes the engine's guided decoding (vLLM structured outputs, a structural
tag from the hermes parser) emit the call, so the test does not depend on what a 135M model
would choose. The conversation policy places each first turn through the prefill pool and a
NIXL handoff (the constraint applies on the decoder), and a later turn with the tool's result
goes back to the same decoder."""
from __future__ import annotations

import json

import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def url(baton_url: str) -> str:
    return baton_url  # the folder's application (conftest.py)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_forced_tool_call_whole_and_streamed(url: str) -> None:
    c = client(url)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                                                      temperature=0, max_tokens=48, extra_headers={"x-session-id": "tools-whole"})
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and isinstance(args["city"], str), call.function.arguments

    stream = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, temperature=0,
                                       max_tokens=48, stream=True, extra_headers={"x-session-id": "tools-stream"})
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                got["id"] = tc.id or got["id"]
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == args  # greedy: the same call, reassembled from its deltas

    # the tool's result goes back in the same conversation, to the same decoder
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "weather": "sunny, 18 C"})}]
    raw2 = c.chat.completions.with_raw_response.create(model=MODEL, messages=history, tools=[WEATHER, TIME], temperature=0,
                                                       max_tokens=16, extra_headers={"x-session-id": "tools-whole"})
    second = raw2.parse()
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<|im_end|>" not in (second.choices[0].message.content or "")  # special tokens kept for the parser, not EOS
    print(f"\nforced call: {call.function.name}({call.function.arguments}); after the result: {second.choices[0].message!r}")
    assert raw2.headers["x-baton-replica"] == raw.headers["x-baton-replica"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's KV, on its decoder


def test_required_tool_choice_and_bad_tools(url: str) -> None:
    c = client(url)
    reply = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=48)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [t.function.name for t in reply.choices[0].message.tool_calls] == ["get_weather"]

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
    plain = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
