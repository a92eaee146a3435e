"""The native function-calling replay loop against a fake OpenAI server (httpx.MockTransport)
that answers from a script: tool calls (streamed in pieces, or whole as JSON), then text."""

import asyncio
import json
import re

import httpx
import pytest

from baton.traces.format import Conversation, Turn
from baton.traces.replay import replay
from baton.traces.report import format_table, summarize, write_json

pytest.importorskip("bfcl_eval", reason="bfcl_eval (pip install --no-deps bfcl-eval) is not installed")


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


def _call(name, arguments, call_id=None):
    return {"id": call_id, "name": name, "arguments": arguments}


class ScriptedOpenAI:
    """Per session, the n-th request gets script[n]: a str (text) or a list of calls."""

    def __init__(self, script, whole_json=False):
        self.script, self.whole_json = script, whole_json
        self.requests: list[dict] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        nth = sum(r["session_id"] == body["session_id"] for r in self.requests)
        self.requests.append(body)
        reply = self.script[min(nth, len(self.script) - 1)]
        if self.whole_json:
            return httpx.Response(200, json=self._whole(reply))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(reply))

    @staticmethod
    def _whole(reply):
        message = {"role": "assistant", "content": reply if isinstance(reply, str) else None}
        if not isinstance(reply, str):
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in reply]
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3}}

    async def _stream(self, reply):
        def event(delta, finish=None):
            return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()

        yield event({"role": "assistant", "content": ""})
        await asyncio.sleep(0.002)
        if isinstance(reply, str):
            yield event({"content": reply})
        else:  # id + name first, then the arguments in two pieces, as OpenAI streams them
            for i, c in enumerate(reply):
                head = {"index": i, "type": "function", "function": {"name": c["name"], "arguments": ""}}
                yield event({"tool_calls": [{**head, **({"id": c["id"]} if c["id"] else {})}]})
                half = len(c["arguments"]) // 2
                for piece in (c["arguments"][:half], c["arguments"][half:]):
                    yield event({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        yield event({}, "tool_calls" if not isinstance(reply, str) else "stop")
        usage = {"prompt_tokens": 10, "completion_tokens": 3}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()


def _native(cid="n1", turns=("add them", "thanks")):
    return Conversation(conversation_id=cid, system="SYS", source="test",
                        tools=[_tool("add"), _tool("divide")], tool_env={"classes": ["MathAPI"]},
                        turns=[Turn(role="user", content=t, think_time_s=0.0) for t in turns])


CALLS = [_call("add", '{"a": 1, "b": 2}', "c1"), _call("add", '{"a": 1,', "c2"),
         _call("nope", "{}", "c3"), _call("divide", '{"a": 1, "b": 0}', None)]


def _run(server, convs, **kw):
    return asyncio.run(replay(convs, "http://fake", 2, progress=False,
                              transport=httpx.MockTransport(server.handler), **kw))


@pytest.mark.parametrize("whole_json", [False, True], ids=["streamed", "whole-json"])
def test_tool_calls_then_text(whole_json):
    server = ScriptedOpenAI([CALLS, "three", "you are welcome"], whole_json=whole_json)
    result = _run(server, [_native()])
    first, second, third = server.requests
    assert first["tools"] == [_tool("add"), _tool("divide")] and first["tool_choice"] == "auto"
    assert first["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "add them"}]

    assistant, *tool_msgs = second["messages"][2:]
    assert assistant["role"] == "assistant" and assistant["content"] is None
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert ids == ["c1", "c2", "c3", "call_0_0_3"]  # the id-less call gets a minted one
    assert [c["function"] for c in assistant["tool_calls"]] == [
        {"name": c["name"], "arguments": c["arguments"]} for c in CALLS]
    assert [m["role"] for m in tool_msgs] == ["tool"] * 4
    assert [m["tool_call_id"] for m in tool_msgs] == ids
    assert tool_msgs[0]["content"] == '{"result": 3}'
    assert "not valid JSON" in tool_msgs[1]["content"]
    assert "Function nope is not available" in tool_msgs[2]["content"]
    assert "error" in tool_msgs[3]["content"].lower()
    assert third["messages"][-2:] == [{"role": "assistant", "content": "three"},
                                      {"role": "user", "content": "thanks"}]

    t = result.turns
    assert [(r.turn_index, r.trace_turn, r.tool_round, r.role) for r in t] == [
        (0, 0, 0, "user"), (1, 0, 1, "tool"), (2, 1, 0, "user")]
    assert [(r.tool_calls, r.tool_calls_parseable, r.tool_calls_ok) for r in t] == [(4, 2, 1), (0, 0, 0), (0, 0, 0)]
    assert [r.effective for r in t] == [False, True, True]
    assert all(r.ok and r.ttft_s is not None and r.prompt_tokens == 10 for r in t)
    (conv,) = result.conversations
    assert (conv.tool_calls, conv.tool_calls_parseable, conv.tool_calls_ok) == (4, 2, 1)
    assert conv.turns_sent == 3 and conv.error is None
    assert conv.ttfet_s == pytest.approx(t[1].send_time_s + t[1].ttft_s - t[0].send_time_s)
    summary = summarize(result)
    assert (summary.tool_calls, summary.tool_calls_parseable, summary.tool_calls_parseable_share) == (4, 2, 0.5)
    table = format_table(summary)
    assert re.search(r"parseable tool-call share +0\.500", table) and re.search(r"made / parseable / ok +4 / 2 / 1", table)


def test_tool_rounds_are_bounded(tmp_path):
    server = ScriptedOpenAI([[_call("add", '{"a": 1, "b": 1}', "k")]])  # always calls
    result = _run(server, [_native(turns=("loop", "next"))], max_tool_rounds=2)
    assert [(r.trace_turn, r.tool_round) for r in result.turns] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # the last round's calls were executed too: the history stays valid for the next user turn
    fourth = server.requests[3]["messages"]
    assert [m["role"] for m in fourth[-3:]] == ["assistant", "tool", "user"]
    assert result.conversations[0].tool_calls == 6 == result.conversations[0].tool_calls_ok
    doc = json.loads(write_json(result, tmp_path / "r.json").read_text())
    assert doc["summary"]["tool_calls_parseable_share"] == 1.0
    assert doc["turns"][1]["tool_round"] == 1 and doc["conversations"][0]["tool_calls"] == 6


def test_native_and_prompting_conversations_mix():
    server = ScriptedOpenAI(["plain"])
    plain = Conversation(conversation_id="p", turns=[Turn(role="user", content="hi")])
    result = _run(server, [plain, _native("n", turns=("hi",))])
    by_id = {r["session_id"]: r for r in server.requests}
    assert "tools" not in by_id["p"] and "tools" in by_id["n"]
    assert all(r.ok and r.tool_calls == 0 for r in result.turns)
    assert summarize(result).tool_calls_parseable_share is None


def test_failed_request_ends_the_conversation():
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(400, json={"error": {"message": "tools_unavailable", "type": "BadRequestError"}})

    result = asyncio.run(replay([_native()], "http://fake", 1, progress=False, transport=httpx.MockTransport(handler)))
    (conv,) = result.conversations
    assert conv.turns_sent == 1 and "HTTP 400" in conv.error and conv.tool_calls == 0


def test_cli_wiring(tmp_path, capsys):
    from baton.cli import build_parser, main
    from baton.traces.format import dump_trace

    args = build_parser().parse_args(["replay", "t.jsonl", "--url", "http://x", "--max-tool-rounds", "1"])
    assert args.max_tool_rounds == 1
    assert build_parser().parse_args(["trace", "bfcl", "--out", "o"]).mode == "prompting"
    path = dump_trace([_native()], tmp_path / "n.jsonl")
    assert main(["trace", "check", str(path)]) == 0
    assert "1 native (tool calls run live)" in capsys.readouterr().out
