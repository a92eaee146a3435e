"""BFCL multi-turn -> agentic conversations, built from the installed bfcl_eval wheel."""

import json

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl_eval (pip install --no-deps bfcl-eval) is not installed")

from baton.traces.bfcl import BfclOptions, build_bfcl_trace
from baton.traces.bfcl_tools import ToolSession, parse_call

SMALL = BfclOptions(n=2, max_user_turns=2)


def test_deterministic_and_shaped():
    a, b = build_bfcl_trace(SMALL), build_bfcl_trace(SMALL)
    assert a == b
    assert [c.conversation_id for c in a] == ["bfcl-multi_turn_base_0", "bfcl-multi_turn_base_1"]
    for conv in a:
        assert conv.source.startswith("bfcl:multi_turn_base_")
        assert conv.system and "Here is a list of functions in JSON format" in conv.system
        roles = [t.role for t in conv.turns]
        assert roles == ["user", "tool"] * (len(roles) // 2)  # every user turn has calls here
        assert all(t.effective == (t.role == "tool") for t in conv.turns)
        assert conv.turns[0].think_time_s == 0.0
        assert all(t.think_time_s > 0 for t in conv.turns[1:])


def test_tool_results_are_executed():
    conv = build_bfcl_trace(BfclOptions(n=1, max_user_turns=1))[0]
    results = json.loads(conv.turns[1].content)
    assert [r["call"] for r in results] == [
        "cd(folder='document')", "mkdir(dir_name='temp')",
        "mv(source='final_report.pdf', destination='temp')"]
    assert results[0]["result"] == {"current_working_directory": "document"}
    assert "moved to 'temp/final_report.pdf'" in results[2]["result"]["result"]


def test_seed_changes_think_times_only():
    a = build_bfcl_trace(SMALL)[0]
    b = build_bfcl_trace(BfclOptions(n=2, max_user_turns=2, seed=7))[0]
    assert [t.content for t in a.turns] == [t.content for t in b.turns]
    assert [t.think_time_s for t in a.turns] != [t.think_time_s for t in b.turns]


def test_filters_and_ids():
    convs = build_bfcl_trace(BfclOptions(n=2, min_user_turns=3, max_system_chars=12000,
                                         drop_response_schema=True, max_tokens=48))
    assert all(len(c.system or "") <= 12000 for c in convs)
    assert all(t.max_tokens == 48 for c in convs for t in c.turns)
    picked = build_bfcl_trace(BfclOptions(ids=("multi_turn_base_3", "multi_turn_base_1")))
    assert [c.source for c in picked] == ["bfcl:multi_turn_base_3", "bfcl:multi_turn_base_1"]
    with pytest.raises(KeyError, match="multi_turn_base_9999"):
        build_bfcl_trace(BfclOptions(ids=("multi_turn_base_9999",)))
    with pytest.raises(ValueError, match="unknown BFCL categories"):
        build_bfcl_trace(BfclOptions(categories=("nope",)))


def test_miss_func_adds_functions_turn():
    conv = build_bfcl_trace(BfclOptions(categories=("miss_func",), n=1))[0]
    assert '"name": "sort"' not in (conv.system or "")  # held out of the system prompt
    added = [t for t in conv.turns if "I have updated some more functions" in t.content]
    assert len(added) == 1 and '"name": "sort"' in added[0].content
    # the turn before has no ground-truth calls: the model should answer the user directly
    user_turns = [t for t in conv.turns if t.role == "user"]
    assert any(t.effective for t in user_turns)


def test_tool_session_failures_become_results():
    tools = ToolSession(["MathAPI"], {}, long_context=False)
    assert tools.execute("add(a=1, b=2)").result == '{"result": 3}'
    assert tools.execute("nope(1)").result.startswith("Error during execution: Function nope")
    assert tools.execute("add(a=__import__('os'))").result.startswith("Error during execution")
    assert tools.execute("kill()").result.endswith("is not allowed.")
    assert tools.execute("divide(a=1, b=0)").result.startswith(("Error", '{"error"'))
    with pytest.raises(ValueError, match="not allowed"):
        ToolSession(["WebSearchAPI"], {}, long_context=False)


def test_parse_call():
    assert parse_call("f(1, b='x', c=[1, 2])") == ("f", [1], {"b": "x", "c": [1, 2]})
    for bad in ["x.y()", "f(g())", "1 + 2", "f(**{'a': 1})"]:
        with pytest.raises(ValueError):
            parse_call(bad)


def test_excluded_functions_are_never_shown():
    """BFCL withholds `excluded_function` from the model for an entry (multi_turn_base_3: mv),
    in the prompting mode's system prompt and in native mode's tools alike."""
    prompting = build_bfcl_trace(BfclOptions(ids=("multi_turn_base_3",)))[0]
    native = build_bfcl_trace(BfclOptions(ids=("multi_turn_base_3",), mode="native"))[0]
    assert '"name": "mv"' not in (prompting.system or "") and '"name": "cp"' in (prompting.system or "")
    names = {t["function"]["name"] for t in native.tools or ()}
    assert "mv" not in names and "cp" in names
