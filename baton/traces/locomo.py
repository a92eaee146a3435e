"""LoCoMo conversations -> long multi-session Baton conversations.

One LoCoMo file (conv-N.json, two speakers, up to ~30 dated sessions) becomes one conversation.
The assistant sits in the chat between speaker_a (the client, `user`) and speaker_b:

- mode "line" (default): a user turn ends at each of speaker_a's lines; it carries every line
  said since the previous turn (speaker_b's lines folded in as context), each as
  "Name: text", so the model answers after every line of speaker_a. The first turn of a session
  starts with "[Session K, <date time>]". Think time is `line_think_s` (uniform, seeded) within
  a session and `session_gap_s` before a session's first turn (the real gap is days).
- mode "session": each session is one user turn holding its whole transcript.
- `qa_questions` > 0 appends that many LoCoMo QA questions (in file order) as final user turns,
  probing what the model remembers of the whole history.

Image shares are folded into the text as "[shares a photo: <caption>]". All turns are
effective=true (a chat reply is meant for the user).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from baton.paths import SHARED
from baton.traces.format import Conversation, Turn

SYSTEM_PROMPT = (
    "You are a friendly assistant taking part in a long-running chat between {a} and {b}. "
    "Each message shows what was said since your last reply. Reply briefly and remember "
    "details across sessions: they may ask you about them later."
)


@dataclass(frozen=True)
class LocomoOptions:
    data_dir: Path
    samples: tuple[str, ...] = ()  # e.g. ("conv-26",); default: every conv-*.json, sorted
    mode: Literal["line", "session"] = "line"
    max_sessions: int | None = None
    max_turns: int | None = None  # cap on dialog turns per conversation (before QA turns)
    qa_questions: int = 0
    max_tokens: int = 64
    seed: int = 0
    line_think_s: tuple[float, float] = (1.0, 4.0)
    session_gap_s: float = 10.0


def _session_numbers(sample: dict[str, Any]) -> list[int]:
    nums = [int(m.group(1)) for k in sample if (m := re.fullmatch(r"session_(\d+)", k))]
    return sorted(n for n in nums if sample[f"session_{n}"])


def _line(entry: dict[str, Any]) -> str:
    text = entry.get("text", "").strip()
    caption = entry.get("blip_caption")
    if caption:
        text = f"{text} [shares a photo: {caption}]".strip()
    return f"{entry['speaker']}: {text}"


def _dialog_chunks(sample: dict[str, Any], opts: LocomoOptions) -> list[tuple[bool, str]]:
    """(starts_a_session, content) per user turn, in order (see the module docstring)."""
    chunks: list[tuple[bool, str]] = []
    speaker_a = sample["speaker_a"]
    pending: list[str] = []
    for k in _session_numbers(sample)[: opts.max_sessions]:
        header = f"[Session {k}, {sample.get(f'session_{k}_date_time', 'date unknown')}]"
        lines = [_line(e) for e in sample[f"session_{k}"]]
        if opts.mode == "session":
            chunks.append((True, "\n".join([header, *lines])))
            continue
        pending.append(header)
        session_start = True
        for entry, line in zip(sample[f"session_{k}"], lines, strict=True):
            pending.append(line)
            if entry["speaker"] == speaker_a:
                chunks.append((session_start, "\n".join(pending)))
                pending, session_start = [], False
    if opts.mode == "line" and pending:  # speaker_b had the last word: one more turn
        chunks.append((False, "\n".join(pending)))
    return chunks[: opts.max_turns]


def sample_to_conversation(name: str, sample: dict[str, Any], opts: LocomoOptions) -> Conversation:
    rng = random.Random(f"{opts.seed}:{name}")
    turns: list[Turn] = []
    for starts_session, content in _dialog_chunks(sample, opts):
        think = opts.session_gap_s if starts_session else round(rng.uniform(*opts.line_think_s), 3)
        turns.append(Turn(role="user", content=content, think_time_s=think if turns else 0.0,
                          max_tokens=opts.max_tokens, effective=True))
    for qa in sample.get("qa", [])[: opts.qa_questions]:
        turns.append(Turn(role="user", content=qa["question"], max_tokens=opts.max_tokens,
                          think_time_s=round(rng.uniform(*opts.line_think_s), 3)))
    if not turns:
        raise ValueError(f"LoCoMo sample {name} has no dialog turns")
    a, b = sample["speaker_a"], sample["speaker_b"]
    return Conversation(conversation_id=f"locomo-{name}", user=a.lower(),
                        system=SYSTEM_PROMPT.format(a=a, b=b), source=f"locomo:{name}",
                        turns=turns)


def build_locomo_trace(opts: LocomoOptions) -> list[Conversation]:
    """One conversation per LoCoMo file. Raises FileNotFoundError if the data is not there."""
    data_dir = Path(opts.data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"LoCoMo data directory not found: {data_dir} "
                                "(expected conv-*.json files; see ../shared/data/locomo)")
    names = list(opts.samples) or sorted(p.stem for p in data_dir.glob("conv-*.json"))
    if not names:
        raise FileNotFoundError(f"no conv-*.json files in LoCoMo data directory {data_dir}")
    convs = []
    for name in names:
        path = data_dir / f"{name}.json"
        if not path.is_file():
            raise FileNotFoundError(f"LoCoMo sample not found: {path}")
        convs.append(sample_to_conversation(name, json.loads(path.read_text("utf-8")), opts))
    return convs


def default_locomo_dir() -> Path:
    """../shared/data/locomo relative to the repository root."""
    return SHARED / "data" / "locomo"
