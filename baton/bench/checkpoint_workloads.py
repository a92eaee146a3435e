"""The two request streams of `baton bench checkpoints`, as token-id prompts (tiny-LFM2's tokenizer).

shared_prompts : BFCL v4 multi-turn (installed bfcl_eval): the tool-doc system prompt of an entry
                 + one of its user questions, every question of every entry as its own request,
                 in a seeded shuffled order. Entries with the same tool classes share the whole
                 system prompt; all share BFCL's preamble and often the first classes' docs.
long_documents : LoCoMo (../shared/data/locomo): a conversation is the document; each `qa`
                 question is asked after the sessions up to its latest evidence session (the
                 point of the conversation where it can be answered), so questions of one
                 document share prefixes ending at session boundaries. Seeded shuffled order
                 across documents. Absent data → the workload is skipped (None).
"""
from __future__ import annotations

import json
import random
import re
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
