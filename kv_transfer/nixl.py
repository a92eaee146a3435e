"""ConServe handoff over NIXL: vLLM's own NixlConnector, plus a count of what it really moved.

Three things live here:
- `side_channel_env()`: the environment one engine process needs before its engine is built.
- `nixl_kv_transfer_config(role, buffer_device)`: the EngineArgs `kv_transfer_config` dict that
  selects the counting connector below (kv_transfer/config.py calls it).
- `CountingNixlConnector`: vLLM's NixlConnector (the pull/READ connector) that also writes every
  transfer it takes part in to this process's ledger (kv_transfer/ledger.py).

This module does not import vLLM at import time: the ingress and the Serve driver import
kv_transfer/config.py, and vLLM must be imported only in the engine process, after its
environment is set. vLLM's KVConnectorFactory loads the class by
`getattr(import_module("kv_transfer.nixl"), "CountingNixlConnector")`, which builds it on first
use (module `__getattr__`).

Side channel (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py): the
scheduler half of the connector reads VLLM_NIXL_SIDE_CHANNEL_HOST/PORT through `vllm.envs` when
the engine is built, listens there (ZMQ) for handshakes, and puts host and port into every
prefill's kv_transfer_params (remote_host/remote_port), which is where decode engines connect.
The port is offset by the data-parallel index (port + dp index), so one engine with DP=1 uses
exactly the port given. vLLM caches `vllm.envs` once an engine core is up, so the values must be
in os.environ before the engine is built, and one process serves one side channel.

On CPU hosts the connector lowers NIXL's own threads to nice 19 (see lower_thread_priority).
vLLM enables a few NIXL-only settings by connector *name* (`has_connector("NixlConnector")`);
under our name they stay off. The one that matters on CPU: hybrid (Mamba) models need
VLLM_SSM_CONV_STATE_LAYOUT=DS in the engine environment, which vLLM would otherwise set itself;
kv_transfer/config.py's NIXL_ENGINE_ENV puts it in every handoff engine's EngineSpec.env.

Hybrid models (HMA): the subclass inherits vLLM's `SupportsHMA` from NixlBaseConnector, so the
hybrid KV cache manager stays on, and with it vLLM's own hybrid P/D: the prefill stops one token
short, the attention blocks and the recurrent (conv/SSM) state blocks of every transfer group move
in one read, the decoder recomputes the last token (docs/hybrid_pd.md). vLLM knows the state
layout of Mamba1/Mamba2/GDN layers only; kv_transfer/short_conv.py adds LFM2's short conv. Both `request_finished`
and `request_finished_all_groups` (HMA's per-group block ids) are counted below.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from kv_transfer.ledger import process_ledger
from kv_transfer.ports import reserve_port

logger = logging.getLogger("baton.kv_transfer")

SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
CONNECTOR_NAME = "CountingNixlConnector"
CONNECTOR_MODULE = "kv_transfer.nixl"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
BUFFER_DEVICES = ("cpu", "cuda")


def side_channel_env(host: str | None = None, port: int | None = None) -> dict[str, str]:
    """Environment for one engine process's NIXL side channel (merge into EngineSpec.env).

    host: default this node's IP when Ray is initialized here, else 127.0.0.1.
    port: default a port reserved for this process's life (kv_transfer/ports.py: below the
    kernel's ephemeral range, held by a per-port lock), so two engines starting at once, or any
    socket bound to port 0 meanwhile, cannot take it before vLLM's handshake listener binds it.
    """
    if host is None:
        host = _node_ip()
    if port is None:
        port = reserve_port(host).port
    return {SIDE_CHANNEL_HOST_ENV: host, SIDE_CHANNEL_PORT_ENV: str(port)}


def nixl_kv_transfer_config(role: str, buffer_device: str) -> dict[str, Any]:
    """The `kv_transfer_config` dict for EngineArgs that selects CountingNixlConnector.

    role: "kv_producer" (prefill engines) or "kv_both" / "kv_consumer" (decode engines).
    A failed pull is recomputed by the decode engine ("recompute"), so the request still succeeds;
    vLLM's default ("fail") would end the request with an error.
    """
    if role not in KV_ROLES:
        raise ValueError(f"kv role must be one of {KV_ROLES}, got {role!r}")
    if buffer_device not in BUFFER_DEVICES:
        raise ValueError(f"kv buffer device must be one of {BUFFER_DEVICES}, got {buffer_device!r}")
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_buffer_device": buffer_device,
        "kv_load_failure_policy": "recompute",
    }


def _node_ip() -> str:
    ray = sys.modules.get("ray")  # never import Ray for this: only ask it when it is already up
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


def kv_bytes_per_block(kv_caches: dict[str, Any], num_blocks: int) -> int:
    """Bytes one KV block occupies over all layers: each distinct cache tensor's bytes / num_blocks.

    Tensors that are views of the same memory (same data pointer) count once.
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    seen: set[int] = set()
    total = 0
    for t in kv_caches.values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    if total % num_blocks:
        raise ValueError(f"KV cache bytes {total} are not a multiple of {num_blocks} blocks")
    return total // num_blocks


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: nothing to find
        return set()


PROGRESS_DELAY_US = 1000


def install_progress_delay(delay_us: int = PROGRESS_DELAY_US) -> bool:
    """Make NIXL agents created from now on in this process pause `delay_us` between progress
    polls instead of spinning (nixl's `_api.py` hard-codes pthrDelay=0: one full core per engine,
    measured 2.97 s of CPU per 3 s idle, 0.07 s with a 1 ms pause). Done by giving nixl's binding a
    config subclass that replaces a 0 delay; returns False if this nixl build has no such knob.
    Idempotent. CPU hosts only: on GPUs the spin buys latency and cores are plentiful."""
    try:
        import nixl._api as nixl_api
    except ImportError:
        return False
    binding = nixl_api.nixlBind
    base = binding.nixlAgentConfig
    if getattr(base, "_baton_progress_delay", None) is not None:
        return True
    if not hasattr(base(), "pthrDelay"):
        return False

    class _PausingAgentConfig(base):  # type: ignore[misc, valid-type]
        _baton_progress_delay = delay_us

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    binding.nixlAgentConfig = _PausingAgentConfig
    return True


def lower_thread_priority(thread_ids: set[int], niceness: int = 19) -> list[int]:
    """Give these threads of this process the lowest CPU priority; returns those changed.

    NIXL's agent runs a progress thread that polls its backends with no pause (nixl `_api.py`
    sets pthrDelay=0 and vLLM offers no way to change it): one full core per engine even when
    idle. On a CPU host that core is the engines' own; at nice 19 the poller only takes what the
    forward passes leave. (Turning the thread off instead stalls the handoff: the prefill engine
    then makes no UCX progress while it is idle.)
    """
    changed = []
    for tid in sorted(thread_ids & _thread_ids()):  # only this process's live threads
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)  # Linux: a thread id sets one thread
        except OSError:  # the thread ended meanwhile
            continue
        changed.append(tid)
    return changed


def _build_connector_class() -> type:
    """Subclass vLLM's NixlConnector (imports vLLM; called in the engine process only)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.platforms import current_platform

    class CountingNixlConnector(NixlConnector):  # type: ignore[misc, valid-type]
        """NixlConnector that records, per request, the KV it pulled or served.

        Consumer (worker half): a request's reads are posted in `start_load_kv` for exactly the
        blocks in its metadata (`reqs_to_recv[id].local_block_ids`, the blocks the scheduler
        allocated for remote tokens; without DCP / differing block sizes NIXL reads exactly
        these), and the request is done when `get_transfer_results` reports it in
        finished_recving (failed when also in failed_recving).
        Producer: the scheduler half's `request_finished` says which blocks are held for a
        reader; the worker half reports them freed in finished_sending, read by the consumer
        when the consumer's notification arrived, else released because the lease expired.
        Request ids are vLLM's internal ones. Bytes are blocks × bytes per block over all layers:
        exact with one KV cache group (full attention, e.g. SmolLM2); with several groups
        (hybrid models) blocks are summed over groups and only nixl_bytes_read is exact.
        """

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
            before = _thread_ids()
            if role == KVConnectorRole.WORKER:
                from kv_transfer import short_conv

                short_conv.install()  # LFM2's conv state through the same hybrid descriptors
            if role == KVConnectorRole.WORKER and current_platform.device_type == "cpu":
                install_progress_delay()
            super().__init__(vllm_config, role, kv_cache_config)  # the worker half starts NIXL's threads
            self._ledger = process_ledger()
            self._served_now: set[str] = set()
            self._served_known = True
            if role == KVConnectorRole.WORKER:
                self._watch_consumer_notifications()
                if current_platform.device_type == "cpu":
                    started = lower_thread_priority(_thread_ids() - before)
                    logger.info("NIXL started threads %s; lowered to nice 19 (its progress thread never sleeps)", started)

        # ---- worker half ---------------------------------------------------------------
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            super().register_kv_caches(kv_caches)
            self._ledger.set_bytes_per_block(kv_bytes_per_block(kv_caches, self.kv_cache_config.num_blocks))

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            for req_id, meta in self._get_connector_metadata().reqs_to_recv.items():
                blocks = sum(len(group) for group in meta.local_block_ids)
                if blocks:  # zero blocks: a full local hit or an abort, P is only notified
                    peer = meta.remote.engine_id if meta.remote is not None else None
                    self._ledger.begin_receive(req_id, blocks, peer)
            super().start_load_kv(forward_context, **kwargs)

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            results = super().get_transfer_results(finished_req_ids)
            for req_id in results.finished_recving:
                self._ledger.end_receive(req_id, ok=req_id not in results.failed_recving)
            for req_id in results.finished_sending:
                self._ledger.note_released(req_id, served=req_id in self._served_now or not self._served_known)
            self._served_now.clear()
            return results

        def get_kv_connector_stats(self) -> Any:
            stats = super().get_kv_connector_stats()
            if stats is not None:
                self._ledger.add_nixl_bytes(sum(stats.data.get("bytes_transferred", ())))
            return stats

        def _watch_consumer_notifications(self) -> None:
            """Producer side: remember which requests a consumer reported as read this step.

            The worker's `_get_new_notifs` (the per-mode hook vLLM's pull worker implements)
            returns them; lease expiry adds the others to finished_sending afterwards."""
            worker = self.connector_worker
            original = getattr(worker, "_get_new_notifs", None)
            if original is None:
                logger.warning("NIXL worker has no _get_new_notifs: every release counts as served")
                self._served_known = False
                return

            def notified() -> set[str]:
                ids = original()
                self._served_now.update(ids)
                return ids

            worker._get_new_notifs = notified

        # ---- scheduler half ------------------------------------------------------------
        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            delay_free, params = super().request_finished(request, block_ids)
            self._note_offered(request.request_id, delay_free, params)
            return delay_free, params

        def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            delay_free, params = super().request_finished_all_groups(request, block_ids)
            self._note_offered(request.request_id, delay_free, params)
            return delay_free, params

        def _note_offered(self, request_id: str, delay_free: bool, params: dict[str, Any] | None) -> None:
            # do_remote_prefill in the returned params: a prefill whose blocks now wait for a reader
            if delay_free and params and params.get("do_remote_prefill"):
                blocks = sum(len(group) for group in params.get("remote_block_ids") or ())
                self._ledger.note_offered(request_id, blocks)

    CountingNixlConnector.__module__ = __name__
    CountingNixlConnector.__qualname__ = CONNECTOR_NAME
    return CountingNixlConnector


_connector_class: type | None = None


def __getattr__(name: str) -> Any:
    """Build CountingNixlConnector on first access (PEP 562), so importing this module is cheap."""
    global _connector_class
    if name == CONNECTOR_NAME:
        if _connector_class is None:
            _connector_class = _build_connector_class()
        return _connector_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
