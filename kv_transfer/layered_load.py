"""A step's synchronous segment loads, written layer by layer on a helper thread while the forward
pass runs (kv_transfer/segment_worker.py): vLLM calls the connector's `wait_for_layer_load` before
each attention layer, so layer i's attention waits only for layer i's KV, and the writes of later
layers overlap the compute of earlier ones instead of all preceding the forward pass.

Each load is a generator that writes one layer per `next()` (its checks run on the first); a load
that raises is recorded as failed and its remaining layers skipped, and every layer is released
anyway, so the forward pass never hangs — vLLM then recomputes the failed blocks (their sampled
tokens are discarded) as for any failed synchronous load. `join` (from `wait_for_save`, before the
step's output is read) waits for the last write and returns the failed loads.

Only for eager execution: a captured graph would not call `wait_for_layer_load` between its layers.
Invariant: once `join` returns, every layer event is set and no write of this step is in flight.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Generic, TypeVar

Load = TypeVar("Load")


class LayeredLoad(Generic[Load]):
    def __init__(self, executor: Executor, writes: list[tuple[Load, Iterator[None]]], num_layers: int):
        if num_layers <= 0:
            raise ValueError(f"a layered load needs layers, got {num_layers}")
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._failed: list[tuple[Load, BaseException]] = []
        self._future = executor.submit(self._run, writes)

    def _run(self, writes: list[tuple[Load, Iterator[None]]]) -> None:
        live = list(writes)
        try:
            for event in self._layers:
                for item in list(live):
                    load, layer_writes = item
                    try:
                        next(layer_writes)
                    except StopIteration:
                        live.remove(item)
                    except Exception as e:  # noqa: BLE001 - one load fails; the others go on
                        self._failed.append((load, e))
                        live.remove(item)
                event.set()
            for load, layer_writes in live:  # past the last layer: what each load does once written
                try:
                    for _ in layer_writes:
                        pass
                except Exception as e:  # noqa: BLE001
                    self._failed.append((load, e))
        finally:
            for event in self._layers:
                event.set()

    def wait_layer(self, index: int) -> None:
        """Block until every load has written layer `index` (or failed)."""
        if 0 <= index < len(self._layers):
            self._layers[index].wait()

    def join(self) -> list[tuple[Load, BaseException]]:
        """Wait for every write; the loads that failed, with why."""
        self._future.result()
        return list(self._failed)
