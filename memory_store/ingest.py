"""Pure helpers that turn conversations into fact texts.

- conversation_facts(messages): an OpenAI-style message list -> one "Speaker: text" fact per
  user/assistant turn (system and tool messages are skipped).
- LoCoMo (../shared/data/locomo/conv-N.json; top-level keys speaker_a, speaker_b,
  session_K [{speaker, dia_id, text, blip_caption?}], session_K_date_time,
  events_session_K {<speaker>: [event, ...], date}, qa [{question, answer?, evidence,
  category, adversarial_answer?}]):
    locomo_facts(sample, name, "dialog" | "events") -> FactBatch (one source per granularity)
    locomo_qa(sample) -> [LocomoQA]
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SPEAKERS = {"user": "User", "assistant": "Assistant"}
Granularity = Literal["dialog", "events"]


def message_text(content: Any) -> str:
    """The text of an OpenAI message's content: a string, or a list of parts whose "text"
    parts are joined with newlines (images and other parts are ignored)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str))
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def conversation_facts(messages: Sequence[Mapping[str, Any]],
                       speakers: Mapping[str, str] = SPEAKERS) -> list[str]:
    """One fact per user/assistant message with non-blank text, "Speaker: text", in order.
    A message with a "name" field uses it as the speaker."""
    facts = []
    for m in messages:
        role = m.get("role")
        if role not in speakers:
            continue
        text = message_text(m.get("content")).strip()
        if text:
            facts.append(f"{m.get('name') or speakers[role]}: {text}")
    return facts


@dataclass(frozen=True)
class FactBatch:
    source: str  # e.g. "locomo:conv-26:dialog"
    texts: tuple[str, ...]
    refs: tuple[str, ...]  # per text: its dia_id ("D3:7") or, for events, "S3:Caroline:0"


@dataclass(frozen=True)
class LocomoQA:
    question: str
    answer: str  # "" for adversarial questions without an answer
    evidence: tuple[str, ...]  # dia_ids ("D1:3")
    category: int
    adversarial: bool  # category 5: the answer is not in the conversation


def load_locomo(path: Path) -> dict[str, Any]:
    sample = json.loads(Path(path).read_text("utf-8"))
    if not isinstance(sample, dict) or "speaker_a" not in sample:
        raise ValueError(f"{path} is not a LoCoMo conversation (no speaker_a)")
    return sample


def _numbers(sample: Mapping[str, Any], pattern: str) -> list[int]:
    nums = [int(m.group(1)) for k in sample if (m := re.fullmatch(pattern, k))]
    return sorted(nums)


def _dialog_line(entry: Mapping[str, Any]) -> str:
    text = str(entry.get("text", "")).strip()
    caption = entry.get("blip_caption")
    if caption:
        text = f"{text} [shares a photo: {caption}]".strip()
    return f"{entry['speaker']}: {text}"


def locomo_facts(sample: Mapping[str, Any], name: str, granularity: Granularity = "dialog",
                 *, dated: bool = True) -> FactBatch:
    """Facts of one LoCoMo conversation in order. dialog: one per turn ("Speaker: text");
    events: one per event in events_session_K (speaker_a's, then speaker_b's; "Speaker: " is
    prefixed to the few events that do not name their speaker). dated: prefix
    each fact with "[<session date>] " (temporal questions need it)."""
    texts: list[str] = []
    refs: list[str] = []
    if granularity == "dialog":
        for k in _numbers(sample, r"session_(\d+)"):
            date = sample.get(f"session_{k}_date_time", "")
            for entry in sample[f"session_{k}"] or []:
                line = _dialog_line(entry)
                texts.append(f"[{date}] {line}" if dated and date else line)
                refs.append(str(entry.get("dia_id", f"D{k}:{len(refs)}")))
    elif granularity == "events":
        order = [sample["speaker_a"], sample["speaker_b"]]
        for k in _numbers(sample, r"events_session_(\d+)"):
            events = sample[f"events_session_{k}"] or {}
            date = events.get("date", "")
            speakers = order + sorted(s for s in events if s not in order and s != "date")
            for speaker in speakers:
                for i, event in enumerate(events.get(speaker) or []):
                    event = str(event).strip()
                    if not event:
                        continue
                    if speaker.lower() not in event.lower():  # a few events omit their subject
                        event = f"{speaker}: {event}"
                    texts.append(f"[{date}] {event}" if dated and date else event)
                    refs.append(f"S{k}:{speaker}:{i}")
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    return FactBatch(f"locomo:{name}:{granularity}", tuple(texts), tuple(refs))


def locomo_qa(sample: Mapping[str, Any], *, include_adversarial: bool = False) -> list[LocomoQA]:
    """QA items in file order. Adversarial ones (category 5, no answer in the conversation) only
    with include_adversarial. Evidence strings like "D8:6; D9:17" are split."""
    out = []
    for q in sample.get("qa", []):
        adversarial = int(q.get("category", 0)) == 5 or "answer" not in q
        if adversarial and not include_adversarial:
            continue
        evidence = tuple(e.strip() for item in q.get("evidence", [])
                         for e in re.split(r"[;,]", str(item)) if e.strip())
        out.append(LocomoQA(str(q["question"]), str(q.get("answer", "")), evidence,
                            int(q.get("category", 0)), adversarial))
    return out
