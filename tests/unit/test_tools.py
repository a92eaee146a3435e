"""OpenAI tool calling (deployments/tool_schema.py, deployments/tool_calls.py): schema checks as
400s, tools rendered through a real HF chat template (SmolLM2's tokenizer with the shipped
deployments/templates/chatml_tools.jinja), vLLM's hermes parser on realistic and malformed
replies, and streamed deltas that reassemble to the non-streamed calls. No engine: a scripted
backend plays the model."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fakes import FakeBackend, FakeTokenizer
from fastapi.testclient import TestClient

from baton.engine.types import GenerationDelta, GenerationRequest, OutputConstraint, SamplingSpec
from baton.paths import REPO_ROOT
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.protocol import ChatCompletionRequest
from deployments.tool_calls import ToolCalling
from deployments.tool_schema import json_schema_problem

MODEL_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
TEMPLATE = REPO_ROOT / "deployments" / "templates" / "chatml_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup` (scripts/setup.sh)")
    t = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    t.chat_template = TEMPLATE.read_text()
    return t


@pytest.fixture(scope="module")
def hermes(tok: Any) -> ToolCalling:
    return ToolCalling("hermes", tok, "m")


def pieces(tok: Any, text: str) -> list[str]:
    """`text` cut where the model's tokens end (what each engine delta carries)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tok.decode(ids[: i + 1])
        out.append(cur[len(prev):])
        prev = cur
    assert "".join(out) == text
    return out


def client(tok: Any, tools: ToolCalling | None, reply: str = "Hello!", finish_reason: str = "stop") -> tuple[TestClient, FakeBackend]:
    backend = FakeBackend(tokens=pieces(tok, reply), finish_reason=finish_reason)
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(tok), backend=backend, max_model_len=8192, default_max_tokens=64,
                              metrics=RecordingMetrics(), tools=tools)

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return TestClient(build_openai_app(frontend, health)), backend


def chat(c: TestClient, **body: Any) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], **body})


def assert_400(r: httpx.Response, param: str | None = None, code: str | None = "invalid_value") -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert code is None or err["code"] == code, err
    assert param is None or err["param"] == param, err
    return err["message"]


def streamed(r: httpx.Response) -> tuple[str, list[dict[str, Any]], str | None, list[dict[str, Any]]]:
    """(content, calls, finish_reason, tool-call deltas) reassembled from an SSE chat stream."""
    content, calls, finish, deltas = "", {}, None, []
    for block in r.text.split("\n\n"):
        if not block or block == "data: [DONE]":
            continue
        for ch in json.loads(block[len("data: "):])["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                deltas.append(tc)
                call = calls.setdefault(tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                call["function"]["name"] += tc.get("function", {}).get("name") or ""
                call["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = ch["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish, deltas


def names_and_args(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- schema checks: 400 with an OpenAI error body, never a 500 ---------------------------------------------


BAD_TOOLS = [
    ([{"type": "function", "function": {"parameters": {"type": "object"}}}], "tools.0.function.name"),  # no name
    ([{"type": "function", "function": {"name": "has space"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}],
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}], "tools.0.function.parameters"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type"),
    ([WEATHER, WEATHER], "tools.1.function.name"),  # duplicate names
]


@pytest.mark.parametrize("tools,param", BAD_TOOLS, ids=[p for _, p in BAD_TOOLS])
def test_invalid_tools_are_400(tok: Any, hermes: ToolCalling, tools: list[Any], param: str) -> None:
    c, backend = client(tok, hermes)
    assert_400(chat(c, tools=tools), param=param)
    assert backend.requests == []


def test_tool_choice_must_name_a_given_function(tok: Any, hermes: ToolCalling) -> None:
    c, _ = client(tok, hermes)
    msg = assert_400(chat(c, tool_choice={"type": "function", "function": {"name": "get_time"}}), param="tool_choice")
    assert "get_time" in msg
    assert_400(chat(c, tools=None, tool_choice="required"), param="tool_choice")
    r = chat(c, tool_choice="sometimes")
    assert_400(r) and r.json()["error"]["param"].startswith("tool_choice")


def test_tools_without_a_configured_parser_are_400(tok: Any) -> None:
    c, backend = client(tok, None)
    msg = assert_400(chat(c), param="tools", code="tools_unavailable")
    assert "tool calling is not enabled" in msg and backend.requests == []
    assert c.post("/v1/chat/completions", json={"messages": ASK}).status_code == 200  # no tools: served as before


def test_json_schema_problems_are_named() -> None:
    assert json_schema_problem({"type": "object", "properties": {"a": {"type": "integer"}}}) is None
    assert "strin" in (json_schema_problem({"type": "object", "properties": {"a": {"type": "strin"}}}) or "")


# ---- rendering through the model's template ------------------------------------------------------------------


def test_tools_are_rendered_by_the_chat_template(tok: Any, hermes: ToolCalling) -> None:
    c, backend = client(tok, hermes)
    assert chat(c).status_code == 200
    expected = tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<tools>" in expected and '"name": "get_weather"' in expected
    assert list(backend.last.prompt_token_ids) == tok(expected, add_special_tokens=False)["input_ids"]


def test_the_shipped_template_without_tools_is_the_models_own(tok: Any) -> None:
    own = (MODEL_DIR / "chat_template.jinja").read_text()
    convs = [ASK, [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And?"}],
             [*ASK, {"role": "tool", "content": '{"temp": 18}'}]]  # tool results as the BFCL traces send them: no tools field
    for conv in convs:
        for gen in (True, False):
            assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, chat_template=own)


def test_history_with_tool_calls_and_results_is_rendered(tok: Any, hermes: ToolCalling) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    c, backend = client(tok, hermes)
    assert c.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]}).status_code == 200
    text = tok.decode(backend.last.prompt_token_ids)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_calls_as_text() -> None:
    """The model's own template knows no tool_calls: they stay JSON in the content, as before."""
    r = PromptRenderer(FakeTokenizer())
    assert not r.structured_tool_calls
    body = ChatCompletionRequest(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    assert r.template_messages(body.messages) == [{"role": "assistant", "content": '[{"name": "f", "arguments": "{}"}]'}]


def test_memories_lay_out_with_tools_after_the_anchor(tok: Any) -> None:
    """Memory facts sit in the system message; tools follow its text, so the anchor (and each
    fact's position) is the same with and without tools."""
    from memory_store.layout import RecalledFact, memory_prompt

    r = PromptRenderer(tok)
    facts = [RecalledFact("a" * 32, "My dog is called Biscuit.")]
    plain = memory_prompt(r, ASK, facts, user="ana", model="m", window=0, inject=True)
    tooled = memory_prompt(r.with_tools([WEATHER]), ASK, facts, user="ana", model="m", window=0, inject=True)
    assert plain.injection is not None and tooled.injection is not None
    assert plain.injection.facts == tooled.injection.facts and plain.injection.anchor_len == tooled.injection.anchor_len
    assert "<tools>" in tok.decode(tooled.token_ids) and "<tools>" not in tok.decode(plain.token_ids)


# ---- parsing replies (vLLM's hermes parser) -------------------------------------------------------------------


REPLIES = [
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL, "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    (TWO_CALLS, None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("<tool_call>not json at all</tool_call>", "<tool_call>not json at all</tool_call>", []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
]


@pytest.mark.parametrize("reply,content,calls", REPLIES, ids=["call", "text+call", "two calls", "malformed", "text"])
def test_replies_parse_the_same_whole_and_streamed(tok: Any, hermes: ToolCalling, reply: str, content: str | None,
                                                   calls: list[tuple[str, Any]]) -> None:
    tools = [WEATHER, TIME]
    c, _ = client(tok, hermes, reply)
    r = chat(c, tools=tools)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["content"] == content
    got = msg.get("tool_calls") or []
    assert names_and_args(got) == calls
    assert all(t["type"] == "function" and t["id"] and isinstance(t["function"]["arguments"], str) for t in got)
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")

    s = chat(c, tools=tools, stream=True)
    s_content, s_calls, s_finish, deltas = streamed(s)
    assert s_content == (content or "") and names_and_args(s_calls) == calls and s_finish == choice["finish_reason"]
    for i in range(len(calls)):  # OpenAI's shape: the first delta of a call has its id, type and name
        first = next(d for d in deltas if d["index"] == i)
        assert first["id"] and first["type"] == "function" and first["function"]["name"] == calls[i][0]
    assert len({c["id"] for c in s_calls}) == len(s_calls)


def test_a_call_cut_off_by_max_tokens(tok: Any, hermes: ToolCalling) -> None:
    """Whole: unparseable, so text (never a 5xx). Streamed: the call was announced before it was
    cut, so the client gets it with the arguments produced so far and finish_reason "length" —
    what vLLM's own server streams for the same reply."""
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    c, _ = client(tok, hermes, cut, finish_reason="length")
    choice = chat(c).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": cut} and choice["finish_reason"] == "length"
    content, calls, finish, _ = streamed(chat(c, stream=True))
    assert content == "" and finish == "length"
    assert [(k["function"]["name"], k["function"]["arguments"]) for k in calls] == [("get_weather", '{"city": "Par')]


def test_parallel_tool_calls_false_keeps_the_first_call(tok: Any, hermes: ToolCalling) -> None:
    c, _ = client(tok, hermes, TWO_CALLS)
    body = chat(c, tools=[WEATHER, TIME], parallel_tool_calls=False).json()
    assert names_and_args(body["choices"][0]["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    _, calls, _, _ = streamed(chat(c, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=True))
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"})]


def test_tool_choice_none_is_plain_text(tok: Any, hermes: ToolCalling) -> None:
    c, backend = client(tok, hermes, CALL)
    body = chat(c, tool_choice="none").json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert body["choices"][0]["finish_reason"] == "stop" and backend.last.sampling.constraint is None
    content, calls, _, _ = streamed(chat(c, tool_choice="none", stream=True))
    assert content == CALL and calls == []


def test_a_parser_that_raises_gives_text(tok: Any, hermes: ToolCalling) -> None:
    class Exploding:
        def parse(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("boom")

        parse_delta = parse

    plan = hermes.plan(ChatCompletionRequest(messages=ASK, tools=[WEATHER]))
    assert plan is not None
    reply = hermes.reply(plan)
    assert reply is not None
    reply._parser = Exploding()
    assert reply.complete(CALL, "stop").content == CALL
    fed = [reply.feed(GenerationDelta(text=t, token_ids=(5,), prompt_tokens=1, cached_tokens=0, finished=i == 1,
                                      finish_reason="stop" if i == 1 else None)) for i, t in enumerate(["<tool_call>", "{}"])]
    assert [p for ps in fed for p in ps] == [({"content": "<tool_call>"}, None), ({"content": "{}"}, None), ({}, "stop")]


# ---- guided decoding for required / named tool_choice ---------------------------------------------------------


def test_required_and_named_tool_choice_constrain_the_output(tok: Any, hermes: ToolCalling) -> None:
    c, backend = client(tok, hermes, CALL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        body = chat(c, tools=[WEATHER, TIME], tool_choice=choice).json()
        constraint = backend.last.sampling.constraint
        assert constraint is not None and constraint.structural_tag is not None
        assert '<tool_call>' in constraint.structural_tag and "get_weather" in constraint.structural_tag
        assert ("get_time" in constraint.structural_tag) == (choice == "required")
        assert backend.last.sampling.skip_special_tokens is False  # hermes: tool tags may be special tokens
        assert names_and_args(body["choices"][0]["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    chat(c, tools=[WEATHER])
    assert backend.last.sampling.constraint is None  # auto: free text


def test_constraints_reach_vllm_sampling_params() -> None:
    from baton.engine.sampling import sampling_params

    def req(constraint: OutputConstraint | None) -> GenerationRequest:
        return GenerationRequest("r", (1, 2), SamplingSpec(max_tokens=4, constraint=constraint))

    tag = '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'
    assert sampling_params(req(OutputConstraint(structural_tag=tag)), None).structured_outputs.structural_tag == tag
    assert sampling_params(req(OutputConstraint(json_schema='{"type": "object"}')), None).structured_outputs.json == {"type": "object"}
    assert sampling_params(req(None), None).structured_outputs is None
    assert sampling_params(req(None), None).skip_special_tokens is True
    with pytest.raises(ValueError):
        OutputConstraint()


def test_a_resumed_constrained_stream_replays_under_its_constraint() -> None:
    """A grammar cannot start mid-output: a forced tool call's stream resumes as a replay of the
    whole request, constraint kept (deployments/resume.py)."""
    from deployments.resume import ResumePlan, ResumeRefused, plan_resume

    constraint = OutputConstraint(json_schema="{}")
    greedy = GenerationRequest("r", (1, 2), SamplingSpec(max_tokens=8, temperature=0.0, constraint=constraint))
    plan = plan_resume(greedy, [5, 6], 0)
    assert isinstance(plan, ResumePlan) and plan.replay == 2
    assert plan.request.sampling == greedy.sampling and plan.request.prompt_token_ids == (1, 2)
    seeded = GenerationRequest("r", (1, 2), SamplingSpec(max_tokens=8, temperature=0.8, seed=3, constraint=constraint))
    assert isinstance(plan_resume(seeded, [5], 0), ResumePlan)
    unseeded = GenerationRequest("r", (1, 2), SamplingSpec(max_tokens=8, temperature=0.8, constraint=constraint))
    assert plan_resume(unseeded, [5], 0) == ResumeRefused("constrained")


# ---- conversations and config -----------------------------------------------------------------------------------


def test_tools_keep_the_conversation(tok: Any, hermes: ToolCalling) -> None:
    c, backend = client(tok, hermes, CALL)
    r = chat(c, session_id="conv-1", user="ana")
    assert r.status_code == 200 and r.headers["x-session-id"] == "conv-1"
    assert backend.last.session_id == "conv-1" and backend.last.user == "ana"


def test_config_names_the_parser_and_the_template(tmp_path: Any) -> None:
    from deployments.app import chat_template_path, check_tool_parser
    from deployments.config import ConfigError, IngressConfig

    cfg = IngressConfig(tool_call_parser="hermes", chat_template="deployments/templates/chatml_tools.jinja")
    assert check_tool_parser(cfg.tool_call_parser) == "hermes"
    assert chat_template_path(cfg.chat_template) == str(TEMPLATE)
    with pytest.raises(ConfigError, match="no tool parser"):
        check_tool_parser("hermes3000")
    with pytest.raises(ConfigError, match="no file"):
        chat_template_path(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError):
        IngressConfig(tool_parser="hermes")  # type: ignore[call-arg]  # extra="forbid": a typo fails


def test_chat_template_file_replaces_the_models(tok: Any) -> None:
    r = PromptRenderer.from_path(str(MODEL_DIR), str(TEMPLATE))
    assert r.structured_tool_calls and not PromptRenderer.from_path(str(MODEL_DIR)).structured_tool_calls
