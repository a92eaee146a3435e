"""kv_transfer/segment_refs.py: a KVSegment packed into a uint8 extent and viewed back; the layout
and the ref a replica pulls it by, with their validation."""
from __future__ import annotations

import pytest
import torch

from kv_transfer.segment_refs import SegmentLayout, SegmentRef, pack, unpack
from kv_transfer.segments import KVSegment

SHAPE = (2, 3, 2, 4)  # L, T, H, D: 48 elements


def seg(value_dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=g, dtype=torch.float32)
    values = torch.randn(shape, generator=g, dtype=torch.float32).to(value_dtype)
    return KVSegment(tuple(range(100, 100 + shape[1])), keys, values)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("value_dtype,itemsize", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)])
def test_pack_unpack_round_trip_is_bit_exact(value_dtype: torch.dtype, itemsize: int) -> None:
    s = seg(value_dtype)
    extent = torch.full((1000,), 0xAB, dtype=torch.uint8)
    layout = pack(s, extent)
    assert layout == SegmentLayout((100, 101, 102), SHAPE, "float32", str(value_dtype).removeprefix("torch."))
    assert (layout.key_nbytes, layout.value_nbytes, layout.nbytes) == (192, 48 * itemsize, 192 + 48 * itemsize)
    assert layout.nbytes == s.nbytes
    assert bool((extent[layout.nbytes:] == 0xAB).all())  # nothing written past the segment
    assert torch.equal(extent[:192], _bits(s.keys).flatten())  # keys first, C order
    back = unpack(extent, layout)
    assert back.token_ids == (100, 101, 102)
    assert back.keys.dtype == torch.float32 and back.values.dtype == value_dtype
    assert tuple(back.keys.shape) == SHAPE and tuple(back.values.shape) == SHAPE
    assert torch.equal(_bits(back.keys), _bits(s.keys))
    assert torch.equal(_bits(back.values), _bits(s.values))


def test_pack_copies_from_non_contiguous_tensors() -> None:
    base = seg(torch.float32, shape=(2, 3, 4, 2))
    s = KVSegment(base.token_ids, base.keys.transpose(2, 3), base.values.transpose(2, 3))
    assert not s.keys.is_contiguous()
    extent = torch.zeros(s.nbytes, dtype=torch.uint8)
    back = unpack(extent, pack(s, extent))
    assert torch.equal(back.keys, s.keys) and torch.equal(back.values, s.values)


def test_unpack_is_a_view_into_the_extent() -> None:
    s = seg(torch.bfloat16)
    buf = torch.zeros(4096, dtype=torch.uint8)
    extent = buf[1024:2048]
    layout = pack(s, extent)
    back = unpack(extent, layout)
    lo, hi = buf.data_ptr() + 1024, buf.data_ptr() + 1024 + layout.nbytes
    assert back.keys.data_ptr() == lo
    assert back.values.data_ptr() == lo + layout.key_nbytes
    assert back.values.data_ptr() + layout.value_nbytes == hi
    buf[1024:1028] = 0  # writing the extent changes the view: no copy
    assert back.keys.flatten()[0].item() == 0.0
    back.values.zero_()  # and the other way round
    assert bool((buf[1024 + layout.key_nbytes : 1024 + layout.nbytes] == 0).all())


def test_extent_too_small_or_wrong_dtype_or_rank_raises() -> None:
    s = seg(torch.bfloat16)
    layout = SegmentLayout.of(s)
    assert layout.nbytes == 288
    for bad in (torch.zeros(287, dtype=torch.uint8), torch.zeros(288, dtype=torch.int8),
                torch.zeros(72, dtype=torch.float32), torch.zeros(2, 288, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="1-D uint8"):
            pack(s, bad)
        with pytest.raises(ValueError, match="1-D uint8"):
            unpack(bad, layout)
    exact = torch.zeros(288, dtype=torch.uint8)
    assert pack(s, exact) == layout  # exactly big enough is fine
    assert unpack(exact, layout).token_ids == s.token_ids


def test_layout_validation() -> None:
    ok = SegmentLayout((1, 2), (1, 2, 1, 8), "float32", "bfloat16")
    assert (ok.key_nbytes, ok.value_nbytes, ok.nbytes) == (64, 32, 96)
    for shape in ((1, 2, 8), (1, 2, 1, 8, 1), (0, 2, 1, 8), (1, 2, -1, 8), (1, 2, 1, 0)):
        with pytest.raises(ValueError, match="4 positive dims"):
            SegmentLayout((1, 2), shape, "float32", "bfloat16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 token ids"):
        SegmentLayout((1, 2, 3), (1, 2, 1, 8), "float32", "bfloat16")
    for bad in ("float33", "Tensor", "randn", ""):
        with pytest.raises(ValueError, match="unknown dtype"):
            SegmentLayout((1, 2), (1, 2, 1, 8), bad, "bfloat16")
        with pytest.raises(ValueError, match="unknown dtype"):
            SegmentLayout((1, 2), (1, 2, 1, 8), "float32", bad)


def test_layout_sizes_per_dtype() -> None:
    shape = (3, 5, 2, 7)  # 210 elements
    assert SegmentLayout(tuple(range(5)), shape, "float32", "float16").nbytes == 210 * 4 + 210 * 2
    lay = SegmentLayout(tuple(range(5)), shape, "float32", "float32")
    assert (lay.key_nbytes, lay.value_nbytes, lay.nbytes) == (840, 840, 1680)
    lay = SegmentLayout(tuple(range(5)), shape, "float16", "uint8")
    assert (lay.key_nbytes, lay.value_nbytes, lay.nbytes) == (420, 210, 630)


def _ref(**kw) -> SegmentRef:
    args = dict(agent="peer", addr=4096, device_id=0, mem_type="DRAM",
                layout=SegmentLayout((1,), (1, 1, 1, 4), "float32", "bfloat16"), lease_s=30.0)
    args.update(kw)
    return SegmentRef(**args)  # type: ignore[arg-type]


def test_segment_ref_validation_and_size() -> None:
    r = _ref()
    assert r.nbytes == 16 + 8
    assert _ref(mem_type="VRAM", device_id=3, addr=1, lease_s=0.001).mem_type == "VRAM"
    for bad in ("dram", "GPU", ""):
        with pytest.raises(ValueError, match="mem_type"):
            _ref(mem_type=bad)
    for kw in ({"agent": ""}, {"addr": 0}, {"addr": -4096}, {"lease_s": 0.0}, {"lease_s": -1.0}):
        with pytest.raises(ValueError, match="agent, an address and a positive lease"):
            _ref(**kw)
