"""Fidelity of KV injection for `baton bench memory`: how close injected memories come to computing
the same tokens in the prompt.

At each position of a reference answer (teacher forcing: the prompt plus the reference's first i
tokens), every mode's next-token distribution is read from the engine over the whole vocabulary
(SamplingSpec.top_logprobs = -1). Per mode, against prompt injection (every token computed, the
reference):
- top-1 agreement: the share of positions where the mode's most likely token is prompt mode's;
- KL(prompt || mode), mean over positions, in nats (0 when the distributions are the same);
- top-1 accuracy along the reference (the share of reference tokens predicted as the top token);
and, at the headline k only, token-F1 of greedy answers against the reference.
One cache salt per (question, mode): the requests of one answer share the prompt's prefix as a
plain prefix-cache hit; no mode reads another mode's cache.
"""
from __future__ import annotations

import dataclasses
import math
import re
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ANSWER_POSITIONS = 12  # reference tokens scored per question


def kl_divergence(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(P || Q) in nats from two distributions given as {token: logprob} over the same vocabulary.
    P's support must be within Q's (a token P gives mass that Q does not list makes it undefined)."""
    missing = [t for t, lp in p.items() if lp > -math.inf and t not in q]
    if missing:
        raise ValueError(f"{len(missing)} tokens of P are not in Q (e.g. {missing[0]}): not over the same vocabulary")
    total = 0.0
    for t, lp in p.items():
        if lp == -math.inf:
            continue
        lq = q[t]
        if lq == -math.inf:
            return math.inf
        total += math.exp(lp) * (lp - lq)
    return max(0.0, total)  # rounding can leave a tiny negative


def top1(dist: Mapping[int, float]) -> int:
    return max(dist, key=lambda t: (dist[t], -t))


def f1(pred: str, ref: str) -> float:
    """Token-F1 of a generated answer against the reference (words, case-folded)."""
    p, r = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", ref.lower())
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r or not common:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


@dataclass(frozen=True)
class ModeScore:
    positions: int
    top1_accuracy: float
    top1_agreement_with_prompt: float
    kl_to_prompt_mean: float
    kl_to_prompt_p95: float
    answer_f1: float | None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Position:
    """One scored position of one mode: its top token is the reference's (correct), is prompt
    mode's (agrees), and KL(prompt || mode) there."""
    correct: bool
    agrees: bool
    kl: float


class Tally:
    """Per mode, the positions scored so far. Distributions are reduced to Positions as each
    question's arrive: a whole-vocabulary distribution is megabytes as a dict, so a full run that
    kept them all would not fit in memory."""

    def __init__(self) -> None:
        self._positions: dict[str, list[Position]] = {}
        self._f1s: dict[str, list[float]] = {}

    def add(self, dists: Mapping[str, Sequence[Mapping[int, float]]], refs: Sequence[int],
            f1s: Mapping[str, float] | None = None) -> None:
        """One question: per mode its distributions at the same positions as dists["prompt"] (refs:
        the reference token at each); every question must bring the same modes."""
        base = dists["prompt"]
        if self._positions and set(dists) != set(self._positions):
            raise ValueError(f"modes {sorted(dists)} differ from the earlier questions' {sorted(self._positions)}")
        for mode, ds in dists.items():
            if len(ds) != len(base) or len(refs) != len(base):
                raise ValueError(f"mode {mode} has {len(ds)} positions, prompt {len(base)}, refs {len(refs)}")
        for mode, ds in dists.items():
            self._positions.setdefault(mode, []).extend(
                Position(top1(d) == r, top1(d) == top1(b), kl_divergence(b, d)) for d, b, r in zip(ds, base, refs, strict=True))
            if f1s is not None and mode in f1s:
                self._f1s.setdefault(mode, []).append(f1s[mode])

    def scores(self) -> dict[str, ModeScore]:
        out = {}
        for mode, ps in self._positions.items():
            kls = sorted(p.kl for p in ps)
            n = max(1, len(ps))
            f1s = self._f1s.get(mode)
            out[mode] = ModeScore(
                positions=len(ps),
                top1_accuracy=sum(p.correct for p in ps) / n,
                top1_agreement_with_prompt=sum(p.agrees for p in ps) / n,
                kl_to_prompt_mean=sum(kls) / n,
                kl_to_prompt_p95=kls[max(0, math.ceil(0.95 * len(kls)) - 1)] if kls else float("nan"),
                answer_f1=(sum(f1s) / len(f1s)) if f1s else None,
            )
        return out


async def _distribution(runner: Any, ids: Sequence[int], segs: Any, salt: str) -> dict[int, float]:
    from baton.engine.types import GenerationRequest, SamplingSpec

    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                            sampling=SamplingSpec(max_tokens=1, temperature=0.0, top_logprobs=-1), cache_salt=salt)
    dist: dict[int, float] = {}
    async for d in runner.generate(req, injection=segs):
        if d.top_logprobs:
            dist = d.top_logprobs[0]
    if not dist:
        raise RuntimeError("the engine returned no logprobs (is max_logprobs = -1 set?)")
    return dist


async def _answer(runner: Any, ids: Sequence[int], segs: Any, max_tokens: int) -> list[int]:
    from baton.engine.types import GenerationRequest, SamplingSpec

    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0), cache_salt=uuid.uuid4().hex)
    out: list[int] = []
    async for d in runner.generate(req, injection=segs):
        out.extend(d.token_ids)
    return out


async def measure_question(runner: Any, renderer: Any, cases: Mapping[str, Any], tally: Tally, with_f1: bool) -> None:
    """One question: cases maps mode -> its case (.prompt.token_ids, .prepared_kv, .answer); "prompt"
    is the reference and its case's KV is not used. Scored into `tally`."""
    ref = renderer.text_tokens(cases["prompt"].answer)[:ANSWER_POSITIONS]
    dists: dict[str, list[dict[int, float]]] = {}
    f1s: dict[str, float] = {}
    for m, c in cases.items():
        segs = None if m == "prompt" else c.prepared_kv
        salt = uuid.uuid4().hex
        dists[m] = [await _distribution(runner, tuple(c.prompt.token_ids) + tuple(ref[:j]), segs, salt) for j in range(len(ref))]
        if with_f1:
            out = await _answer(runner, c.prompt.token_ids, segs, 24)
            f1s[m] = f1(renderer.decode(out), c.answer)
    tally.add(dists, ref, f1s if with_f1 else None)
