"""Trace format: round trip, and errors that name the line and the field."""

import json

import pytest

from baton.paths import SAMPLE_TRACES
from baton.traces.format import Conversation, TraceError, Turn, dump_trace, load_trace

SAMPLES = SAMPLE_TRACES


def _conv(cid: str = "c1") -> Conversation:
    return Conversation(
        conversation_id=cid, user="u1", system="tools: []", source="test",
        turns=[Turn(role="user", content="hi", effective=False, max_tokens=8),
               Turn(role="tool", content='{"r": 1}', think_time_s=0.5, memories={"k": 20})])


def test_round_trip(tmp_path):
    convs = [_conv("a"), _conv("b"), Conversation(conversation_id="c", turns=[Turn(role="user", content="x")])]
    path = dump_trace(convs, tmp_path / "t.jsonl")
    assert load_trace(path) == convs
    first = json.loads(path.read_text().splitlines()[0])
    assert "ticks" not in first["turns"][0]  # unset optional fields are omitted


def test_defaults():
    conv = Conversation.model_validate({"conversation_id": "x", "turns": [{"role": "user", "content": "hi"}]})
    assert conv.user == "anonymous" and conv.system is None
    turn = conv.turns[0]
    assert (turn.think_time_s, turn.max_tokens, turn.effective, turn.memories) == (0.0, 64, True, None)


def _write(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _good_line(cid="ok"):
    return _conv(cid).model_dump_json()


@pytest.mark.parametrize("bad, field", [
    ({"conversation_id": "x", "turns": [{"role": "user", "content": "a", "think_time_s": -1}]},
     "turns.0.think_time_s"),
    ({"conversation_id": "x", "turns": [{"role": "assistant", "content": "a"}]}, "turns.0.role"),
    ({"conversation_id": "x", "turns": []}, "turns"),
    ({"conversation_id": "x", "turns": [{"role": "user", "content": "a", "colour": 1}]},
     "turns.0.colour"),
    ({"conversation_id": "x", "extra_key": 1, "turns": [{"role": "user", "content": "a"}]},
     "extra_key"),
    ({"turns": [{"role": "user", "content": "a"}]}, "conversation_id"),
])
def test_bad_line_names_line_and_field(tmp_path, bad, field):
    path = _write(tmp_path, [_good_line(), "", json.dumps(bad)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line_no == 3
    assert "bad.jsonl:3:" in str(info.value)
    assert f"'{field}'" in str(info.value)


def test_not_json_and_duplicate_ids(tmp_path):
    with pytest.raises(TraceError, match=r":2: not valid JSON"):
        load_trace(_write(tmp_path, [_good_line(), "{nope"]))
    with pytest.raises(TraceError, match=r":1: expected a JSON object"):
        load_trace(_write(tmp_path, ["[1, 2]"]))
    with pytest.raises(TraceError, match=r":2: field 'conversation_id': duplicate 'ok'"):
        load_trace(_write(tmp_path, [_good_line(), _good_line()]))


@pytest.mark.parametrize("name", ["smoke.jsonl", "agentic_small.jsonl"])
def test_committed_samples_load(name):
    convs = load_trace(SAMPLES / name)
    assert convs and all(c.turns for c in convs)


def test_agentic_sample_shape():
    convs = load_trace(SAMPLES / "agentic_small.jsonl")
    assert len(convs) == 6
    for conv in convs:
        assert 4 <= len(conv.turns) <= 6
        assert len(conv.system or "") / 4 < 3000  # tool docs fit the small-model demo
        assert all(t.max_tokens == 48 for t in conv.turns)
