"""Standalone NIXL agents (outside vLLM's connector): the memory store's arena and the replicas'
segment pullers (memory_store/arena.py, kv_transfer/segment_pull.py).

`make_agent` builds one UCX agent. The owner of registered memory that others READ from needs a
progress thread (UCX only completes a remote read while the target makes progress); a pure reader
progresses its own transfers by polling and needs none. On CPU hosts the progress thread pauses
between polls and runs at nice 19 (kv_transfer/nixl.py explains why). Both sides use strict thread
sync: pulls run in worker threads, several at a time.
"""
from __future__ import annotations

import logging
from typing import Any

from kv_transfer.nixl import _thread_ids, install_progress_delay, lower_thread_priority

logger = logging.getLogger("baton.kv_transfer")


class NixlUnavailable(RuntimeError):
    """This process cannot make a NIXL agent (not installed, or no usable backend)."""


def make_agent(name: str, *, progress_thread: bool, on_cpu: bool = True) -> Any:
    """A NIXL agent named `name` with the UCX backend; raises NixlUnavailable if none can be made."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as e:
        raise NixlUnavailable(f"nixl is not importable: {e}") from e
    if on_cpu and progress_thread:
        install_progress_delay()
    before = _thread_ids()
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
    except Exception as e:  # nixl raises its own backend errors
        raise NixlUnavailable(f"NIXL agent {name!r} could not start: {e}") from e
    if "UCX" not in agent.backends:
        raise NixlUnavailable("NIXL has no UCX backend here")
    if on_cpu:
        lower_thread_priority(_thread_ids() - before)
    return agent
