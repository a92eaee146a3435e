"""Native function-calling traces: BFCL docs -> OpenAI tools, names, the native builder, the
JSON-call executor, and the trace format's native fields."""

import re

import pytest
from jsonschema import Draft202012Validator

from baton.traces.bfcl_schema import NAME_RE, json_schema, openai_names, openai_tool, renamed
from baton.traces.format import Conversation, Turn, load_trace
from deployments.tool_schema import FunctionTool, json_schema_problem

pytest.importorskip("bfcl_eval", reason="bfcl_eval (pip install --no-deps bfcl-eval) is not installed")

from baton.cli import main
from baton.traces.bfcl import (
    FUNC_DOC_FILES,
    NATIVE_SYSTEM_PROMPT,
    BfclOptions,
    _class_docs,
    bfcl_data_dir,
    build_bfcl_trace,
)
from baton.traces.bfcl_tools import ToolSession

ALL_DOCS = [(c, d) for c in FUNC_DOC_FILES for d in _class_docs(bfcl_data_dir(), c)]
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _types(schema):
    yield schema.get("type")
    for sub in (schema.get("properties") or {}).values():
        yield from _types(sub)
    if "items" in schema:
        yield from _types(schema["items"])


@pytest.mark.parametrize("cls, doc", ALL_DOCS, ids=[f"{c}.{d['name']}" for c, d in ALL_DOCS])
def test_every_bfcl_doc_converts_to_a_valid_tool(cls, doc):
    tool = openai_tool(doc)
    params = tool["function"]["parameters"]
    Draft202012Validator.check_schema(params)  # the 2020-12 meta-schema accepts it
    assert json_schema_problem(params) is None
    FunctionTool.model_validate(tool)  # the server's own check of a request's tool
    assert params["type"] == "object" and set(params.get("required", [])) <= set(params["properties"])
    assert set(tool["function"]) == {"name", "description", "parameters"}  # no "response"
    assert {t for t in _types(params) if t is not None} <= JSON_TYPES
    assert tool["function"]["name"] == doc["name"] and NAME_RE.match(doc["name"])


def test_bfcl_types_map_to_json_schema():
    bfcl = {"type": "dict", "required": ["a"], "optional": True, "properties": {
        "a": {"type": "float", "description": "x", "default": 1.5},
        "b": {"type": "tuple", "items": {"type": "dict", "properties": {"c": {"type": "any"}}}},
        "d": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "e": {"type": ["string", "null"], "enum": ["x", None]}}}
    assert json_schema(bfcl) == {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "number", "description": "x", "default": 1.5},
        "b": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
        "d": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "e": {"type": ["string", "null"], "enum": ["x", None]}}}
    with pytest.raises(ValueError, match="unknown BFCL type"):
        json_schema({"type": "strin"})


def test_name_mapping_round_trip():
    names = ["math.factorial", "math_factorial", "x" * 70, "ok-name_1", "a b.c", "é", "x" * 64]
    mapping = openai_names(names)
    assert set(mapping) == set(names)
    assert all(NAME_RE.match(v) for v in mapping.values())
    assert len(set(mapping.values())) == len(names)  # reversible
    assert {v: k for k, v in mapping.items()}["math_factorial"] == "math_factorial"
    assert mapping["math.factorial"] == "math_factorial_2" and mapping["ok-name_1"] == "ok-name_1"
    back = renamed(mapping)  # what a trace records: the changed names only
    assert "ok-name_1" not in back and back[mapping["a b.c"]] == "a b.c"
    assert {back.get(v, v) for v in mapping.values()} == set(names)
    bfcl = [d["name"] for _, d in ALL_DOCS]  # the multi-turn names are already valid
    assert renamed(openai_names(bfcl)) == {}


NATIVE = BfclOptions(n=3, max_user_turns=3, mode="native")


def test_native_builder(tmp_path):
    a, b = build_bfcl_trace(NATIVE), build_bfcl_trace(NATIVE)
    assert a == b  # deterministic
    prompting = build_bfcl_trace(BfclOptions(n=3, max_user_turns=3))
    for conv, text in zip(a, prompting, strict=True):
        assert conv.system == NATIVE_SYSTEM_PROMPT and "Here is a list of functions" not in conv.system
        names = [t["function"]["name"] for t in conv.tools]
        assert names and not any(re.search(rf'"{n}"', conv.system) for n in names)
        assert conv.tool_env.classes and conv.tool_env.names == {}
        assert all(t.role == "user" and t.effective for t in conv.turns)
        assert [t.content for t in conv.turns] == [t.content for t in text.turns if t.role == "user"]
        assert conv.turns[0].think_time_s == 0.0
    out = tmp_path / "n.jsonl"
    assert main(["trace", "bfcl", "--mode", "native", "--out", str(out), "--n", "3",
                 "--max-user-turns", "3"]) == 0
    assert load_trace(out) == a


def test_native_miss_func_adds_tools():
    conv = build_bfcl_trace(BfclOptions(categories=("miss_func",), n=1, mode="native"))[0]
    assert "sort" not in {t["function"]["name"] for t in conv.tools}
    (added,) = [t for t in conv.turns if t.add_tools]
    assert [t["function"]["name"] for t in added.add_tools] == ["sort"]
    assert added.content == "I have updated some more functions you can choose from. What about now?"


def test_prompting_is_still_the_default_and_unchanged(tmp_path):
    """The bundled sample, rebuilt with its documented command, is byte-identical."""
    from baton.paths import REPO_ROOT
    from baton.traces.format import dump_trace

    sample = REPO_ROOT / "baton/traces/samples/agentic_small.jsonl"
    ids = ("multi_turn_base_56", "multi_turn_base_100", "multi_turn_base_64",
           "multi_turn_base_107", "multi_turn_base_71", "multi_turn_base_115")
    convs = build_bfcl_trace(BfclOptions(ids=ids, max_user_turns=3, drop_response_schema=True,
                                         max_tokens=48))
    assert BfclOptions().mode == "prompting"
    assert dump_trace(convs, tmp_path / "rebuilt.jsonl").read_bytes() == sample.read_bytes()


def test_execute_json():
    tools = ToolSession(["MathAPI"], {}, long_context=False)
    good = tools.execute_json("add", '{"a": 1, "b": 2}')
    assert (good.call, good.result, good.status) == ("add(a=1, b=2)", '{"result": 3}', "ok")
    cases = {
        ("nope", "{}"): ("unparseable", "Function nope is not available."),
        ("add", '{"a": 1,'): ("unparseable", "arguments are not valid JSON"),
        ("add", "[1, 2]"): ("unparseable", "must be a JSON object, not list"),
        ("add", ""): ("unparseable", "not valid JSON"),
        ("kill", "{}"): ("unparseable", "is not allowed"),
        ("_load_scenario", "{}"): ("unparseable", "is not available"),
        ("add", '{"x": 1}'): ("error", "Error during execution"),
        ("add", '{"a": "__import__(\'os\')", "b": 1}'): ("error", "must be numbers"),  # a string, never run
    }
    for (name, args), (status, text) in cases.items():
        r = tools.execute_json(name, args)
        assert r.status == status and text in r.result, (name, args, r)
    assert tools.execute_json("divide", '{"a": 1, "b": 0}').status == "error"
    assert tools.execute("add(a=1, b=2)").status == "ok"
    assert tools.execute("x.y()").status == "unparseable"


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


def test_format_native_fields():
    env = {"classes": ["MathAPI"]}
    conv = Conversation(conversation_id="n", turns=[Turn(role="user", content="hi")], tools=[TOOL], tool_env=env)
    assert conv.native and conv.tool_env.bfcl_name("add") == "add"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
    for kw, match in [
        ({"tools": [TOOL]}, "tools and tool_env go together"),
        ({"tools": [TOOL], "tool_env": env, "turns": [Turn(role="tool", content="[]")]}, "user turns only"),
        ({"tools": [TOOL, TOOL], "tool_env": env}, "used twice"),
        ({"tools": [bad_schema], "tool_env": env}, "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "a.b"}}], "tool_env": env}, "pattern"),
        ({"turns": [Turn(role="user", content="x", add_tools=[TOOL])]}, "add_tools needs"),
    ]:
        with pytest.raises(ValueError, match=match):
            Conversation(**{"conversation_id": "n", "turns": [Turn(role="user", content="hi")], **kw})
    from baton.paths import REPO_ROOT

    for old in ("smoke.jsonl", "agentic_small.jsonl"):  # old traces still load
        assert not any(c.native for c in load_trace(REPO_ROOT / "baton/traces/samples" / old))
