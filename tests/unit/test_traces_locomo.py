"""LoCoMo -> long multi-session chats (skipped when ../shared/data/locomo is missing)."""

import json

import pytest

from baton.traces.locomo import LocomoOptions, build_locomo_trace, default_locomo_dir

DATA = default_locomo_dir()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"LoCoMo data not found at {DATA}")


@needs_data
def test_line_mode():
    opts = LocomoOptions(DATA, samples=("conv-26",), max_sessions=2, qa_questions=2)
    (conv,) = build_locomo_trace(opts)
    assert build_locomo_trace(opts) == [conv]
    assert conv.conversation_id == "locomo-conv-26" and conv.user == "caroline"
    assert "Caroline" in (conv.system or "") and "Melanie" in (conv.system or "")
    assert conv.turns[0].content.startswith("[Session 1, ")
    assert conv.turns[0].think_time_s == 0.0
    session_2 = [t for t in conv.turns if "[Session 2, " in t.content]
    assert len(session_2) == 1 and session_2[0].think_time_s == opts.session_gap_s
    dialog = conv.turns[:-2]
    assert all(t.content.splitlines()[-1].startswith("Caroline: ") for t in dialog[:-1])
    assert any("Melanie: " in t.content for t in dialog)  # the other speaker folded in
    assert conv.turns[-1].content == json.loads((DATA / "conv-26.json").read_text())["qa"][1]["question"]
    assert all(t.role == "user" and t.effective for t in conv.turns)


@needs_data
def test_session_mode_and_caps():
    (conv,) = build_locomo_trace(LocomoOptions(DATA, samples=("conv-30",), mode="session", max_sessions=3))
    assert len(conv.turns) == 3
    assert [t.content.splitlines()[0].split(",")[0] for t in conv.turns] == [
        "[Session 1", "[Session 2", "[Session 3"]
    (capped,) = build_locomo_trace(LocomoOptions(DATA, samples=("conv-30",), max_turns=5))
    assert len(capped.turns) == 5


def test_missing_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="LoCoMo data directory not found"):
        build_locomo_trace(LocomoOptions(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no conv-"):
        build_locomo_trace(LocomoOptions(tmp_path))


def test_tiny_synthetic_sample(tmp_path):
    sample = {"speaker_a": "Ann", "speaker_b": "Bob", "session_1_date_time": "today",
              "session_1": [{"speaker": "Bob", "dia_id": "D1:1", "text": "hi"},
                            {"speaker": "Ann", "dia_id": "D1:2", "text": "hello",
                             "blip_caption": "a cat"},
                            {"speaker": "Bob", "dia_id": "D1:3", "text": "bye"}]}
    (tmp_path / "conv-1.json").write_text(json.dumps(sample))
    (conv,) = build_locomo_trace(LocomoOptions(tmp_path))
    assert [t.content for t in conv.turns] == [
        "[Session 1, today]\nBob: hi\nAnn: hello [shares a photo: a cat]", "Bob: bye"]
