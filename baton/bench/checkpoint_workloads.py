"""The request streams of `baton bench checkpoints`, as token ids (tiny-LFM2's tokenizer).

Prompt lists (single requests, no output; the engine phase and the in-sample sweep use them):

shared_prompts : BFCL v4 multi-turn (installed bfcl_eval): the tool-doc system prompt of an entry
                 + one of its user questions, every question of every entry as its own request,
                 in a seeded shuffled order. Entries with the same tool classes share the whole
                 system prompt; all share BFCL's preamble and often the first classes' docs.
long_documents : LoCoMo (../shared/data/locomo): a conversation is the document; each `qa`
                 question is asked after the sessions up to its latest evidence session (the
                 point of the conversation where it can be answered), so questions of one
                 document share prefixes ending at session boundaries. Seeded shuffled order
                 across documents. Absent data → the workload is skipped (None).

Conversation streams (`Sequence`s of `Timed`, for the online replay of every retention rule):
bfcl_conversations : BFCL v4 multi-turn entries as conversations: turn k's prompt is turn k−1's
                 prompt + its reply + the next message (user question or tool results), appended
                 at the token level (ChatML: the template only ever appends). A reply is a seeded
                 stand-in of `reply_tokens` ids (the trace has no assistant text; the real model's
                 reply would be its own output, cached the same way). Conversations start `gap_s`
                 apart; turn k follows turn k−1 after its think time + `service_s`.
sample_conversations: the same for a trace file (baton/traces/samples/agentic_small.jsonl).
document_questions : long_documents' prompts as a timed stream (one every `gap_s`, no output).
A request's family (`Timed.family`) is the hash of its conversation's first prompt: the system
prompt plus the first user message, so conversations behind one shared system prompt are apart.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC_SYSTEM = "You answer questions about the conversation between {a} and {b} below.\n\n"


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _encode(tok: Any, system: str, user: str) -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def shared_prompts(model_dir: Path, n_entries: int, seed: int = 0) -> list[list[int]]:
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace

    tok = _tokenizer(model_dir)
    convs = build_bfcl_trace(BfclOptions(n=n_entries, categories=("base",), drop_response_schema=True))
    prompts = [_encode(tok, conv.system or "", t.content) for conv in convs for t in conv.turns if t.role == "user"]
    random.Random(seed).shuffle(prompts)
    return prompts


def _session_numbers(sample: dict[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for k in sample if (m := re.fullmatch(r"session_(\d+)", k)) and sample[k])


def _session_text(sample: dict[str, Any], k: int) -> str:
    lines = [f"{e['speaker']}: {e.get('text', '').strip()}" for e in sample[f"session_{k}"]]
    return "\n".join([f"[Session {k}, {sample.get(f'session_{k}_date_time', '')}]", *lines]) + "\n"


def long_documents(model_dir: Path, data_dir: Path, questions_per_doc: int, max_sessions: int | None, seed: int = 0) -> list[list[int]] | None:
    files = sorted(data_dir.glob("conv-*.json")) if data_dir.is_dir() else []
    if not files:
        return None
    tok = _tokenizer(model_dir)
    rng = random.Random(seed)
    prompts = []
    for path in files:
        sample = json.loads(path.read_text("utf-8"))
        sessions = _session_numbers(sample)[:max_sessions]
        if not sessions:
            continue
        texts = {k: _session_text(sample, k) for k in sessions}
        qa = [q for q in sample.get("qa", []) if q.get("question")]
        rng.shuffle(qa)
        for q in qa[:questions_per_doc]:
            ev = [int(m.group(1)) for e in q.get("evidence", []) if (m := re.match(r"D(\d+):", str(e)))]
            upto = max([s for s in sessions if s <= max(ev)], default=sessions[-1]) if ev else sessions[-1]
            doc = "".join(texts[k] for k in sessions if k <= upto)
            system = DOC_SYSTEM.format(a=sample["speaker_a"], b=sample["speaker_b"]) + doc
            prompts.append(_encode(tok, system, q["question"]))
    rng.shuffle(prompts)
    return prompts


@dataclass(frozen=True)
class Timed:
    """One request of a conversation stream: prompt + output token ids, its family and clock."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    family: bytes
    now: float
    conversation: str


def family_key(first_prompt: Sequence[int]) -> bytes:
    return hashlib.blake2b(repr(tuple(first_prompt)).encode(), digest_size=16).digest()


def _suffix_ids(tok: Any, role: str, content: str) -> list[int]:
    """Tokens the chat template appends after an assistant reply for the next message."""
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    head = tok.apply_chat_template(base, tokenize=False, add_generation_prompt=True) + "R"
    full = tok.apply_chat_template([*base, {"role": "assistant", "content": "R"}, {"role": role, "content": content}],
                                   tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise ValueError("the chat template does not append turns (prompt_k would not extend prompt_{k-1})")
    return list(tok(full[len(head):], add_special_tokens=False)["input_ids"])


def conversation_stream(tok: Any, convs: Sequence[Any], reply_tokens: int, gap_s: float, service_s: float, seed: int = 0) -> list[Timed]:
    """Each conversation's turns as appended prompts (see the module docstring), merged by time."""
    out: list[Timed] = []
    for j, conv in enumerate(convs):
        rng = random.Random(f"{seed}:{conv.conversation_id}")
        t = j * gap_s
        prompt = _encode(tok, conv.system or "", conv.turns[0].content)
        fam = family_key(prompt)
        reply: list[int] = []
        for k, turn in enumerate(conv.turns):
            if k:
                t += turn.think_time_s + service_s
                prompt = [*prompt, *reply, *_suffix_ids(tok, turn.role, turn.content)]
            reply = [rng.randrange(1000, 40000) for _ in range(reply_tokens)]
            out.append(Timed(tuple(prompt), tuple(reply), fam, t, conv.conversation_id))
    out.sort(key=lambda r: r.now)
    return out


def bfcl_conversations(model_dir: Path, n_entries: int, reply_tokens: int = 32, gap_s: float = 20.0, service_s: float = 1.0) -> list[Timed]:
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace

    convs = build_bfcl_trace(BfclOptions(n=n_entries, categories=("base",), drop_response_schema=True))
    return conversation_stream(_tokenizer(model_dir), convs, reply_tokens, gap_s, service_s)


def sample_conversations(model_dir: Path, trace: Path, reply_tokens: int = 32, gap_s: float = 20.0, service_s: float = 1.0) -> list[Timed]:
    from baton.traces.format import load_trace

    return conversation_stream(_tokenizer(model_dir), load_trace(trace), reply_tokens, gap_s, service_s)


def document_questions(prompts: Sequence[Sequence[int]], gap_s: float = 2.0, start_s: float = 0.0) -> list[Timed]:
    return [Timed(tuple(p), (), family_key(p), start_s + i * gap_s, f"doc-q{i}") for i, p in enumerate(prompts)]


def merge(*streams: Sequence[Timed]) -> list[Timed]:
    return sorted((r for s in streams for r in s), key=lambda r: r.now)
