"""kv_transfer/paged_layouts.py: the capture path learns the paged-KV layout from the backend's own
write, for vLLM's CPU runs and for the CUDA backends' shapes — FlashAttention [2, N, bs, H, D],
FlashInfer NHD [N, 2, bs, H, D] and HND [N, 2, H, bs, D] — here with fake writers (no GPU) that
store tokens as those kernels do; and a segment worker captures and injects through them."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_transfer.paged_kv import UnsupportedLayout
from kv_transfer.paged_layouts import learn_cache_layout
from kv_transfer.rope import RopeSpec, apply_rope
from kv_transfer.segment_meta import SegmentCapture, SegmentConnectorMetadata, SegmentLoad
from kv_transfer.segment_worker import SegmentWorker
from kv_transfer.segments import KVSegment, SegmentTable

N, BS, H, D = 6, 4, 2, 8


def write_kv_first(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    b, o = slots // cache.shape[2], slots % cache.shape[2]
    cache[0, b, o], cache[1, b, o] = k, v


def write_blocks_first(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    b, o = slots // cache.shape[2], slots % cache.shape[2]
    cache[b, 0, o], cache[b, 1, o] = k, v


def write_blocks_first_hnd(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    b, o = slots // cache.shape[3], slots % cache.shape[3]
    for t in range(len(slots)):
        cache[b[t], 0, :, o[t]], cache[b[t], 1, :, o[t]] = k[t], v[t]


def write_cpu_runs(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    d = cache.shape[3] // 2
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, cache.shape[2])
        cache[b, :, o, :d], cache[b, :, o, d:] = k[t], v[t]


LAYOUTS: dict[str, tuple[tuple[int, ...], Callable[..., None]]] = {
    "kv_first": ((2, N, BS, H, D), write_kv_first),
    "blocks_first": ((N, 2, BS, H, D), write_blocks_first),
    "blocks_first_hnd": ((N, 2, H, BS, D), write_blocks_first_hnd),
    "cpu_runs": ((N, H, BS, 2 * D), write_cpu_runs),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_layout_is_learned_and_reads_what_the_backend_wrote(name: str, dtype: torch.dtype) -> None:
    shape, write = LAYOUTS[name]
    layout = learn_cache_layout(write, torch.zeros(shape, dtype=dtype), BS, D, dtype)
    assert layout.name == name
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(shape, dtype=dtype)
    slots = torch.tensor([5, 0, 17, 9, 23, 12])
    k, v = (torch.randn(len(slots), H, D, generator=g).to(dtype) for _ in range(2))
    write(k, v, cache, slots)
    rk, rv = layout.read(cache, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_a_shape_that_fits_two_layouts_is_decided_by_the_probe() -> None:
    """bs == H: [N, 2, 4, 4, D] is NHD or HND by shape; only the backend's write tells which."""
    shape = (N, 2, 4, 4, D)
    assert learn_cache_layout(write_blocks_first_hnd, torch.zeros(shape), 4, D, torch.float32).name == "blocks_first_hnd"
    assert learn_cache_layout(write_blocks_first, torch.zeros(shape), 4, D, torch.float32).name == "blocks_first"


def test_unknown_shapes_and_wrong_writers_are_refused() -> None:
    with pytest.raises(UnsupportedLayout, match="none of the known layouts"):
        learn_cache_layout(write_kv_first, torch.zeros(3, N, BS, H, D), BS, D, torch.float32)  # 3 is not K/V

    def swaps_k_and_v(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        write_kv_first(v, k, cache, slots)

    with pytest.raises(UnsupportedLayout):
        learn_cache_layout(swaps_k_and_v, torch.zeros(2, N, BS, H, D), BS, D, torch.float32)


class _Impl:
    def __init__(self, write: Callable[..., None]):
        self._write = write

    def do_kv_cache_update(self, layer: Any, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        assert k.device == v.device == slots.device == cache.device  # the load moved them to the cache's device
        self._write(k, v, cache, slots)


@pytest.mark.parametrize("name", ["kv_first", "blocks_first", "blocks_first_hnd"])
def test_a_worker_injects_and_captures_through_a_gpu_shaped_cache(name: str) -> None:
    shape, write = LAYOUTS[name]
    layers = 2
    spec = RopeSpec.unscaled(head_dim=D, base=10000.0, table_dtype=torch.float32, max_positions=64)
    table = SegmentTable()
    worker = SegmentWorker(BS, torch.float32, spec, 64, table=table)
    fc = SimpleNamespace(no_compile_layers={f"model.layers.{i}.attn": SimpleNamespace(kv_cache=torch.zeros(shape), impl=_Impl(write))
                                            for i in range(layers)})
    g = torch.Generator().manual_seed(1)
    seg = KVSegment((1, 2, 3, 4, 5), torch.randn(layers, 5, H, D, generator=g), torch.randn(layers, 5, H, D, generator=g))
    table.offer("k", (seg,))
    slots = (12, 13, 14, 15, 4)  # blocks 3 and 1
    worker.start_load_kv(SegmentConnectorMetadata(loads=[SegmentLoad("k", 0, 5, slots)]), fc)
    assert worker.get_block_ids_with_load_errors() == set()
    worker.wait_for_save(SegmentConnectorMetadata(captures=[SegmentCapture("c", ((1, 4),), seg.token_ids, (slots[1:4],))]))
    (got,) = table.take_capture("c").segments
    assert torch.allclose(got.keys, seg.keys[:, 1:4], atol=1e-5) and torch.equal(got.values, seg.values[:, 1:4])
    rk, _ = (learn_cache_layout(write, torch.zeros(shape), BS, D, torch.float32)
             .read(fc.no_compile_layers["model.layers.0.attn"].kv_cache, torch.tensor(slots)))
    assert torch.allclose(rk, apply_rope(seg.keys[0], torch.arange(5), spec), atol=1e-5)  # laid rotated at its positions
