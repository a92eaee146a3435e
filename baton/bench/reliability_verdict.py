"""Verdicts of `baton bench reliability`, as pure functions (no cluster, no HTTP): when a streamed
answer counts as a success, when a case passes, and the RESULT line.

A streamed answer succeeds only when the client read all of it: status 200, at least one content
chunk, exactly one finish_reason, exactly one `data: [DONE]` with nothing after it, and no error
event. A stream that stops without [DONE] (and without an error event) was cut: the client cannot
tell it from a dropped connection, so it is retryable and never a success.

A case passes only when its own checks held AND it lost no turn, saw no server error and leaked
nothing across users (`settle`): a case cannot pass while its counts say otherwise.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

DONE = "[DONE]"


@dataclass
class StreamSeen:
    """What a client read from one SSE stream (chat or completions), fed line by line."""

    texts: list[str] = field(default_factory=list)  # content chunks, in order
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)  # in-stream error events
    usage: dict[str, Any] | None = None
    done: int = 0  # `data: [DONE]` lines
    after_done: int = 0  # events after the first [DONE]
    malformed: int = 0  # data lines that are not a JSON object

    def feed(self, line: str) -> str | None:
        """One line of the stream; returns the content it carried (None: none)."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if self.done:
            self.after_done += 1
        if data == DONE:
            self.done += 1
            return None
        try:
            ev = json.loads(data)
        except ValueError:
            self.malformed += 1
            return None
        if not isinstance(ev, dict):
            self.malformed += 1
            return None
        if "error" in ev:
            err = ev["error"]
            self.errors.append(err if isinstance(err, dict) else {"message": str(err)})
            return None
        if ev.get("usage"):
            self.usage = ev["usage"]
        got: list[str] = []
        for choice in ev.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reasons.append(str(choice["finish_reason"]))
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")  # chat | completions
            if isinstance(text, str) and text:
                self.texts.append(text)
                got.append(text)
        return "".join(got) or None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def error(self) -> dict[str, Any] | None:
        return self.errors[0] if self.errors else None

    @property
    def cut(self) -> bool:
        """Ended without [DONE] and without saying why (no error event): a dropped stream."""
        return self.done == 0 and not self.errors


@dataclass(frozen=True)
class StreamVerdict:
    ok: bool
    problems: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "ok" if self.ok else "; ".join(self.problems)


def judge_stream(status: int | None, seen: StreamSeen | None) -> StreamVerdict:
    """The one rule for a streamed answer (module docstring)."""
    problems: list[str] = []
    if status != 200:
        problems.append(f"status {status}")
    elif seen is None:
        problems.append("no stream read")
    else:
        if seen.errors:
            problems.append(f"error event {seen.errors[0].get('type') or seen.errors[0].get('code') or '?'}")
        if not seen.texts:
            problems.append("no content chunk")
        if len(seen.finish_reasons) != 1:
            problems.append("no finish_reason" if not seen.finish_reasons else f"{len(seen.finish_reasons)} finish_reasons")
        if seen.done != 1:
            problems.append("no [DONE]" if not seen.done else f"{seen.done} [DONE]s")
        if seen.after_done:
            problems.append(f"{seen.after_done} events after [DONE]")
        if seen.malformed:
            problems.append(f"{seen.malformed} malformed events")
    return StreamVerdict(not problems, tuple(problems))


# ---- cases ---------------------------------------------------------------------------------------
@dataclass
class CaseResult:
    """One case of the bench: what it checked, whether it held, and its counts."""

    name: str
    category: str  # faults | overload | bad_input | security | soak
    passed: bool
    lost_turns: int
    server_errors: int
    isolation_leaks: int
    detail: str
    seconds: float
    answers: dict[str, int] = field(default_factory=dict)  # requests by error class
    figures: dict[str, Any] = field(default_factory=dict)  # measured numbers behind the verdict


def settle(r: CaseResult) -> CaseResult:
    """The case as counted: passed only if its checks held and every count is 0."""
    clean = r.lost_turns == 0 and r.server_errors == 0 and r.isolation_leaks == 0
    if r.passed and not clean:
        return replace(r, passed=False, detail=f"{r.detail} [failed on its counts: lost {r.lost_turns}, 5xx {r.server_errors}, "
                                               f"leaks {r.isolation_leaks}]")
    return r


@dataclass(frozen=True)
class Totals:
    lost_turns: int
    server_errors: int
    isolation_leaks: int
    cases: int
    passed: int

    @property
    def clean(self) -> bool:
        """What the bench promises: every case passed and nothing was lost, failed or leaked."""
        return self.cases > 0 and self.passed == self.cases and not (self.lost_turns or self.server_errors or self.isolation_leaks)


def totals(results: Iterable[CaseResult]) -> Totals:
    rs = list(results)
    return Totals(sum(r.lost_turns for r in rs), sum(r.server_errors for r in rs), sum(r.isolation_leaks for r in rs),
                  len(rs), sum(1 for r in rs if r.passed))


def result_line(t: Totals) -> str:
    return (f"RESULT lost_turns={t.lost_turns} server_errors={t.server_errors} isolation_leaks={t.isolation_leaks} "
            f"cases={t.cases} passed={t.passed}")


def check_names(names: Iterable[str]) -> list[str]:
    """The plan's case names, each once (a repeated name would hide a case in the table)."""
    out = list(names)
    dup = sorted(n for n, k in Counter(out).items() if k > 1)
    if dup:
        raise ValueError(f"case names repeated: {dup}")
    return out


# ---- Prometheus text -------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, metric: str, **labels: str) -> float:
    """Sum of every sample of `metric` (Ray's export may prefix `ray_` and suffix `_total`) whose
    labels include `labels`; 0.0 when there is none."""
    names = {metric, f"ray_{metric}", f"{metric}_total", f"ray_{metric}_total"}
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] not in names:
            continue
        have = dict(_LABEL.findall(m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            try:
                total += float(m["value"])
            except ValueError:
                continue
    return total


def jsonable(x: Any) -> Any:
    """JSON has string keys only: figures keyed by tuples (e.g. per (replica, pool)) keep their
    meaning as 'a|b' strings."""
    if isinstance(x, dict):
        return {("|".join(map(str, k)) if isinstance(k, tuple) else k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
