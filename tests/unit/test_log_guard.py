"""Serve's replica logger survives a library's logging.config.dictConfig (as vLLM and NIXL do)."""
from __future__ import annotations

import logging
import logging.config
import logging.handlers
from pathlib import Path

from deployments.log_guard import serve_logging_kept


def test_a_dictconfig_inside_the_guard_does_not_kill_serve_logging(tmp_path: Path) -> None:
    lg = logging.getLogger("ray.serve")
    old = list(lg.handlers)
    target = logging.FileHandler(tmp_path / "replica.log")
    mem = logging.handlers.MemoryHandler(capacity=1, target=target)
    lg.handlers[:] = [mem]
    lg.setLevel(logging.INFO)
    try:
        with serve_logging_kept():
            logging.config.dictConfig({"version": 1, "disable_existing_loggers": True})
            assert mem.target is None  # what the library did to Serve's handler
        assert mem.target is target and lg.handlers == [mem] and not lg.disabled
        assert mem.target.baseFilename.endswith("replica.log")  # what a recovering controller reads
        lg.info("still logging")
        mem.flush()
        assert "still logging" in (tmp_path / "replica.log").read_text()
    finally:
        lg.handlers[:] = old
        target.close()
