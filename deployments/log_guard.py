"""Keep Ray Serve's replica logging alive across libraries that reconfigure logging.

vLLM (at engine construction) and NIXL (at import) call `logging.config.dictConfig`, which closes
every existing handler. In a Serve replica that closes Serve's own MemoryHandler (its `target`
becomes None), the replica's log file stops, and a recovering Serve controller that asks the
replica for its log path fails on it (`'NoneType' object has no attribute 'baseFilename'` in
ray/serve/_private/logging_utils.py) and stops every engine replica. `serve_logging_kept()`
snapshots the Serve loggers' handlers, targets and enabled state, and puts them back afterwards.
"""
from __future__ import annotations

import logging
import logging.handlers
from collections.abc import Iterator
from contextlib import contextmanager

SERVE_LOGGERS = ("ray.serve",)


@contextmanager
def serve_logging_kept(names: tuple[str, ...] = SERVE_LOGGERS) -> Iterator[None]:
    saved = []
    for name in names:
        lg = logging.getLogger(name)
        targets = [(h, h.target) for h in lg.handlers if isinstance(h, logging.handlers.MemoryHandler)]
        saved.append((lg, list(lg.handlers), targets, lg.disabled, lg.level, lg.propagate))
    try:
        yield
    finally:
        for lg, handlers, targets, disabled, level, propagate in saved:
            lg.handlers[:] = handlers
            for h, target in targets:
                if h.target is None:
                    h.setTarget(target)  # a closed FileHandler reopens on its next record
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)
