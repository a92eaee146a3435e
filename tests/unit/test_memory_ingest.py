"""Conversation and LoCoMo -> fact texts (LoCoMo tests skip when ../shared/data/locomo is absent)."""

from pathlib import Path

import pytest

from memory_store.ingest import conversation_facts, load_locomo, locomo_facts, locomo_qa

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "locomo"
needs_data = pytest.mark.skipif(not (DATA / "conv-26.json").is_file(), reason=f"no LoCoMo data at {DATA}")

SAMPLE = {
    "speaker_a": "Ann", "speaker_b": "Bob",
    "session_1_date_time": "1 May", "session_1": [
        {"speaker": "Ann", "dia_id": "D1:1", "text": "I got a cat."},
        {"speaker": "Bob", "dia_id": "D1:2", "text": "Look!", "blip_caption": "a red bike"}],
    "session_2_date_time": "9 May", "session_2": [{"speaker": "Bob", "dia_id": "D2:1", "text": "Hi"}],
    "session_3_date_time": "10 May",  # no transcript for session 3
    "session_10": [{"speaker": "Ann", "dia_id": "D10:1", "text": "later"}],
    "events_session_1": {"Ann": ["Ann adopts a cat."], "Bob": ["buys a bike", "  "], "date": "1 May"},
    "events_session_2": {"Bob": [], "Ann": [], "date": "9 May"},
    "qa": [{"question": "What pet?", "answer": "a cat", "evidence": ["D1:1"], "category": 1},
           {"question": "Year?", "answer": 2023, "evidence": ["D1:1; D2:1"], "category": 2},
           {"question": "Bob's cat?", "adversarial_answer": "none", "evidence": [], "category": 5}],
}


def test_conversation_facts():
    msgs = [{"role": "system", "content": "be nice"},
            {"role": "user", "content": "I moved to Lyon."},
            {"role": "assistant", "content": [{"type": "text", "text": "Nice!"}, {"type": "image_url"}]},
            {"role": "tool", "content": "{}"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "name": "Ann", "content": "  "},
            {"role": "user", "name": "Ann", "content": "Me again"}]
    assert conversation_facts(msgs) == ["User: I moved to Lyon.", "Assistant: Nice!", "Ann: Me again"]
    assert conversation_facts(msgs[1:2], {"user": "Caroline"}) == ["Caroline: I moved to Lyon."]


def test_locomo_dialog_synthetic():
    b = locomo_facts(SAMPLE, "s", "dialog")
    assert b.source == "locomo:s:dialog"
    assert b.texts == ("[1 May] Ann: I got a cat.", "[1 May] Bob: Look! [shares a photo: a red bike]",
                       "[9 May] Bob: Hi", "Ann: later")
    assert b.refs == ("D1:1", "D1:2", "D2:1", "D10:1")
    assert locomo_facts(SAMPLE, "s", "dialog", dated=False).texts[0] == "Ann: I got a cat."


def test_locomo_events_synthetic():
    b = locomo_facts(SAMPLE, "s", "events")
    assert b.source == "locomo:s:events"
    assert b.texts == ("[1 May] Ann adopts a cat.", "[1 May] Bob: buys a bike")
    assert b.refs == ("S1:Ann:0", "S1:Bob:0")
    with pytest.raises(ValueError):
        locomo_facts(SAMPLE, "s", "turns")


def test_locomo_qa_synthetic():
    qa = locomo_qa(SAMPLE)
    assert [(q.question, q.answer, q.evidence) for q in qa] == [
        ("What pet?", "a cat", ("D1:1",)), ("Year?", "2023", ("D1:1", "D2:1"))]
    with_adv = locomo_qa(SAMPLE, include_adversarial=True)
    assert len(with_adv) == 3 and with_adv[2].adversarial and with_adv[2].answer == ""


@needs_data
def test_real_locomo_conv_26():
    sample = load_locomo(DATA / "conv-26.json")
    dialog = locomo_facts(sample, "conv-26", "dialog")
    events = locomo_facts(sample, "conv-26", "events")
    assert len(dialog.texts) == len(dialog.refs) == len(set(dialog.refs)) > 300
    assert dialog.texts[0] == "[1:56 pm on 8 May, 2023] Caroline: Hey Mel! Good to see you! How have you been?"
    assert events.texts[0] == "[8 May, 2023] Caroline attends an LGBTQ support group for the first time."
    assert len(events.texts) > 10
    qa = locomo_qa(sample)
    assert qa[0].answer == "7 May 2023" and qa[0].evidence == ("D1:3",)
    refs = set(dialog.refs)
    assert all(e in refs for q in qa for e in q.evidence)  # evidence points at dialog facts


def test_load_locomo_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="LoCoMo"):
        load_locomo(p)
