"""Where a request's time to first token went, hop by hop: its StageTimes (baton/engine/types.py,
stamped by the ingress, the backend, the decode replica and its engine thread) as durations.

    parse         received -> prepared          body read and validated, memories recalled,
                                                template and tokenizer (the ingress)
    route         prepared -> placed            the conversation directory's plan
    prefill       placed -> prefilled           remote prefill on the prefill pool + handoff
    to_replica    placed|prefilled -> replica   the ingress -> decode replica handle call
    replica       replica -> engine_added       memory KV resolved, the engine thread's queue
    engine        engine_added -> engine_first  prefill and the first token, in the engine
    from_replica  engine_first -> ingress_first the first delta's way back (replica loop, Ray)
    total         received -> ingress_first     all of the above

A hop whose two ends are not both known is left out (never reported as 0). Durations can be
slightly negative across processes only by clock granularity; they are reported as measured.
The Server-Timing header (W3C Server Timing: `name;dur=<ms>`) carries them to the client; what is
left of the client's TTFT is the HTTP proxy's two hops and the client's own.
"""
from __future__ import annotations

from baton.engine.types import StageTimes

HOPS = ("parse", "route", "prefill", "to_replica", "replica", "engine", "from_replica", "total")


def hop_durations(t: StageTimes) -> dict[str, float]:
    """Seconds per hop (HOPS order), only the hops whose both ends are stamped."""
    before_replica = t.prefilled if t.prefilled is not None else t.placed
    spans = {
        "parse": (t.received, t.prepared),
        "route": (t.prepared, t.placed),
        "prefill": (t.placed, t.prefilled),
        "to_replica": (before_replica, t.replica_received),
        "replica": (t.replica_received, t.engine_added),
        "engine": (t.engine_added, t.engine_first),
        "from_replica": (t.engine_first, t.ingress_first),
        "total": (t.received, t.ingress_first),
    }
    return {name: b - a for name, (a, b) in spans.items() if a is not None and b is not None}


def server_timing(t: StageTimes) -> str:
    """The Server-Timing header value: `parse;dur=1.20, route;dur=3.05, ...` (milliseconds)."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in hop_durations(t).items())


def parse_server_timing(value: str) -> dict[str, float]:
    """The inverse, for clients and benches: hop -> seconds (entries without `dur` skipped)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            if p.startswith("dur="):
                try:
                    out[name] = float(p[4:]) / 1000
                except ValueError:
                    pass
    return out
