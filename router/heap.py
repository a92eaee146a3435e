"""Keep CPython's cyclic garbage collector off a serving process's startup heap.

Why: a directory or ingress replica imports Ray, Serve, FastAPI, a tokenizer: ~144,000 objects the
collector tracks in the directory's process before it holds a single pin (measured). Every
generation-2 collection walks all of them, ~75 ms on this project's 2-core hosts, and it runs on
the thread that serves the event loop, so each one stalls every call in flight: a pinned turn,
a report, a stream. Generation-2 collections come whenever the objects that survived into it grow
by a quarter, so a long-lived replica under churn (pins, reports, requests) keeps having them.

How: once the replica is built, collect what its start left as garbage, then `gc.freeze()` the
rest: those objects move to the permanent generation, which collections no longer walk. They
are the modules, classes and singletons that live as long as the process anyway; what the
replica creates afterwards is collected as before. (CPython's documented use of freeze is
before fork; the same mechanism bounds the pause here.)
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze everything the collector tracks now; the objects frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
