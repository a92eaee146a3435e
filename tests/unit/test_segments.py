"""Position-free KV segments (kv_transfer/segments.py), the per-process SegmentTable, and reading
tokens from a paged cache whose in-block layout is learned (kv_transfer/paged_kv.py).

The paged-cache writers here are pure-python fakes of the attention backend's write op, each with
its own in-block layout; learn_layout must discover it and read_tokens must return exactly what
was written. No vLLM, no engine."""
from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer.paged_kv import (
    PagedLayout,
    UnsupportedLayout,
    check_cache_shape,
    learn_layout,
    read_tokens,
)
from kv_transfer.segments import (
    CaptureResult,
    Injection,
    KVSegment,
    SegmentTable,
    process_segments,
)

L, H, D = 2, 3, 4


def seg(first: int, n: int, fill: float | None = None) -> KVSegment:
    """n tokens with ids first.., keys[l, t] = 1000·l + (first + t) (so slices are checkable)."""
    tok = torch.arange(first, first + n, dtype=torch.float)
    k = (tok[None, :, None, None] + 1000 * torch.arange(L, dtype=torch.float)[:, None, None, None]).expand(L, n, H, D).clone()
    v = -k
    if fill is not None:
        k.fill_(fill)
    return KVSegment(tuple(range(first, first + n)), k, v)


# ---- KVSegment ------------------------------------------------------------------------------------

def test_segment_validation() -> None:
    k = torch.zeros(L, 3, H, D)
    with pytest.raises(ValueError, match="must both be"):
        KVSegment((1, 2, 3), k, torch.zeros(L, 2, H, D))
    with pytest.raises(ValueError, match="must both be"):
        KVSegment((1, 2, 3), k[0], torch.zeros(3, H, D))
    with pytest.raises(ValueError, match="token ids"):
        KVSegment((1, 2), k, k.clone())
    assert KVSegment((1, 2, 3), k, k.clone()).num_tokens == 3


def test_segment_slice_and_nbytes() -> None:
    s = seg(10, 5)
    assert s.nbytes == 2 * L * 5 * H * D * 4
    mid = s.slice(1, 4)
    assert mid.token_ids == (11, 12, 13)
    assert torch.equal(mid.keys, s.keys[:, 1:4]) and torch.equal(mid.values, s.values[:, 1:4])
    assert mid.keys[0, 0, 0, 0].item() == 11 and mid.keys[1, 2, 0, 0].item() == 1013
    halfv = KVSegment(s.token_ids, s.keys, s.values.to(torch.bfloat16))
    assert halfv.nbytes == L * 5 * H * D * (4 + 2)
    with pytest.raises(ValueError):  # an empty slice of a non-empty range keeps shapes consistent
        KVSegment((1,), s.keys[:, :0], s.values[:, :0])
    assert s.slice(2, 2).num_tokens == 0


# ---- Injection.copy_range -------------------------------------------------------------------------

def _copied(inj: Injection, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = torch.full((L, end - start, H, D), float("nan")), torch.full((L, end - start, H, D), float("nan"))
    inj.copy_range(start, end, keys, values)
    return keys, values


def test_injection_tiles_segments_end_to_end() -> None:
    inj = Injection((seg(0, 3), seg(100, 2), seg(200, 4)))
    assert inj.token_ids == (0, 1, 2, 100, 101, 200, 201, 202, 203)
    assert inj.end == 9
    k, v = _copied(inj, 0, 9)
    assert k[0, :, 0, 0].tolist() == [0, 1, 2, 100, 101, 200, 201, 202, 203]
    assert torch.equal(v, -k)


@pytest.mark.parametrize("start,end", [(0, 1), (2, 4), (2, 6), (1, 9), (3, 5), (5, 9), (8, 9)])
def test_copy_range_across_segment_boundaries(start: int, end: int) -> None:
    inj = Injection((seg(0, 3), seg(100, 2), seg(200, 4)))
    k, v = _copied(inj, start, end)
    want = list(inj.token_ids[start:end])
    assert not k.isnan().any() and not v.isnan().any()  # every position written
    assert k[0, :, 1, 2].tolist() == want
    assert k[1, :, 0, 0].tolist() == [1000 + t for t in want]
    assert v[1, :, 0, 0].tolist() == [-(1000 + t) for t in want]


@pytest.mark.parametrize("start,end", [(5, 7), (2, 2), (4, 20), (-1, 2), (3, 1)])
def test_copy_range_outside_the_injection_raises(start: int, end: int) -> None:
    inj = Injection((seg(0, 3), seg(100, 2)))
    buf = torch.zeros(L, max(1, end - start), H, D)
    with pytest.raises(ValueError, match="not within the injected"):
        inj.copy_range(start, end, buf, buf.clone())
    with pytest.raises(ValueError, match="not within the injected"):
        Injection(()).copy_range(0, 1, buf, buf.clone())
    assert Injection(()).end == 0


# ---- SegmentTable ---------------------------------------------------------------------------------

def test_table_lifecycle_leaves_nothing_behind() -> None:
    t = SegmentTable()
    segs = (seg(0, 2), seg(5, 1))
    inj = t.offer("req-a", segs)
    assert isinstance(inj, Injection) and inj.end == 3
    assert t.injection("req-a") is inj and t.injection("req-b") is None
    assert len(t) == 1
    result = CaptureResult(segments=(seg(7, 2),))
    t.put_capture("req-a", result)
    assert len(t) == 2
    assert t.take_capture("req-a") is result
    assert t.take_capture("req-a") is None  # taken once
    assert len(t) == 1
    t.put_capture("req-a", CaptureResult(error="prompt not computed in one step"))
    t.discard("req-a")
    assert len(t) == 0 and t.injection("req-a") is None and t.take_capture("req-a") is None
    t.discard("never-offered")  # idempotent, no error
    assert len(t) == 0


def test_offer_replaces_and_keys_are_independent() -> None:
    t = SegmentTable()
    t.offer("a", (seg(0, 1),))
    t.offer("b", (seg(1, 1),))
    t.offer("a", (seg(9, 2),))
    assert t.injection("a").token_ids == (9, 10)
    t.discard("a")
    assert t.injection("b").token_ids == (1,) and len(t) == 1


def test_table_is_safe_under_threads() -> None:
    t = SegmentTable()

    def worker(i: int) -> None:
        for j in range(50):
            key = f"{i}-{j}"
            t.offer(key, (seg(j, 1),))
            t.put_capture(key, CaptureResult())
            assert t.take_capture(key) is not None
            t.discard(key)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t) == 0


def test_process_table_is_one_per_process() -> None:
    assert process_segments() is process_segments()
    assert isinstance(process_segments(), SegmentTable)


# ---- paged KV: learn_layout + read_tokens with fake backend writers -------------------------------

def _run(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, H, bs·2D] view of a [blocks, H, bs, 2D] cache (writes go through)."""
    return cache.view(cache.shape[0], cache.shape[1], -1)


def write_transposed_keys(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Keys in the first half of each run as [D][block_size], values in the second as [block_size][D]."""
    bs, d = cache.shape[2], cache.shape[3] // 2
    run = _run(cache)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bs)
        for dim in range(d):
            run[b, :, dim * bs + o] = k[t, :, dim]
            run[b, :, bs * d + o * d + dim] = v[t, :, dim]


def write_interleaved_values_first(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Per token [value D | key D reversed] — values before keys, keys' dims reversed."""
    bs, d = cache.shape[2], cache.shape[3] // 2
    run = _run(cache)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, bs)
        base = o * 2 * d
        run[b, :, base : base + d] = v[t]
        run[b, :, base + d : base + 2 * d] = k[t].flip(-1)


def write_values_first_halves(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Values in the first half of each run, keys in the second (a layout that tags alone cannot
    tell apart from keys-first: the probe must tag keys and values differently)."""
    write_transposed_keys(v, k, cache, slots)


def permuted_writer(seed: int):
    """Keys and values each scattered by a fixed random permutation of the whole run."""
    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        bs, d = cache.shape[2], cache.shape[3] // 2
        perm = torch.randperm(2 * bs * d, generator=torch.Generator().manual_seed(seed))
        run = _run(cache)
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, bs)
            for dim in range(d):
                run[b, :, perm[o * d + dim]] = k[t, :, dim]
                run[b, :, perm[bs * d + o * d + dim]] = v[t, :, dim]
    return write


WRITERS = {
    "transposed_keys": write_transposed_keys,
    "interleaved_values_first": write_interleaved_values_first,
    "values_first_halves": write_values_first_halves,
    "random_permutation": permuted_writer(7),
}


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_tokens_returns_what_the_backend_wrote(name: str, dtype: torch.dtype) -> None:
    write = WRITERS[name]
    bs, d, heads, blocks = 4, 8, 2, 5
    layout = learn_layout(write, bs, d, dtype)
    layout.check_integrity()
    assert layout.key_index.shape == (bs, d) and layout.value_index.shape == (bs, d)

    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([17, 3, 4, 9, 0, 19, 10], dtype=torch.long)  # across blocks, out of order
    k = torch.randn(len(slots), heads, d, generator=g).to(dtype)
    v = torch.randn(len(slots), heads, d, generator=g).to(dtype)
    write(k, v, cache, slots)
    rk, rv = read_tokens(cache, slots, layout)
    assert rk.shape == (len(slots), heads, d) and rk.dtype == dtype
    assert torch.equal(rk, k) and torch.equal(rv, v)
    # a subset in another order reads the same tokens
    sub = torch.tensor([2, 5])
    rk2, rv2 = read_tokens(cache, slots[sub], layout)
    assert torch.equal(rk2, k[sub]) and torch.equal(rv2, v[sub])


def test_layouts_of_different_writers_differ() -> None:
    a = learn_layout(write_transposed_keys, 4, 8, torch.float32)
    b = learn_layout(write_interleaved_values_first, 4, 8, torch.float32)
    assert not torch.equal(a.key_index, b.key_index)
    # transposed keys: key (offset o, dim d) at d·bs + o; values at bs·D + o·D + d
    assert a.key_index[1, 2].item() == 2 * 4 + 1 and a.value_index[1, 2].item() == 32 + 1 * 8 + 2
    # values first per token, keys reversed: key (o, d) at o·2D + D + (D-1-d)
    assert b.key_index[1, 2].item() == 16 + 8 + 5 and b.value_index[1, 2].item() == 16 + 2


def test_a_layout_learned_from_a_wrong_writer_is_refused() -> None:
    def keys_only(k, v, cache, slots):  # never writes values
        bs, d = cache.shape[2], cache.shape[3] // 2
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, bs)
            _run(cache)[b, :, o * d : (o + 1) * d] = k[t]

    def values_overwrite_keys(k, v, cache, slots):  # writes everywhere, but values land on keys
        write_transposed_keys(k, v, cache, slots)
        bs, d = cache.shape[2], cache.shape[3] // 2
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, bs)
            _run(cache)[b, :, o * d : (o + 1) * d] = v[t]

    def scaled(k, v, cache, slots):  # a quantizing backend: stored values are not the written ones
        write_transposed_keys(k * 3, v * 3, cache, slots)

    with pytest.raises(UnsupportedLayout):
        learn_layout(keys_only, 4, 8, torch.float32)
    with pytest.raises((UnsupportedLayout, AssertionError)):
        learn_layout(values_overwrite_keys, 4, 8, torch.float32)
    with pytest.raises((UnsupportedLayout, AssertionError)):
        learn_layout(scaled, 4, 8, torch.float32)


def test_check_integrity_rejects_a_non_permutation() -> None:
    good = learn_layout(write_transposed_keys, 2, 2, torch.float32)
    good.check_integrity()
    dup = good.key_index.clone()
    dup[0, 0] = dup[0, 1]
    with pytest.raises(AssertionError, match="permutation"):
        PagedLayout(2, 2, dup, good.value_index).check_integrity()
    shifted = good.value_index + 1  # the last one points past the run
    with pytest.raises(AssertionError):
        PagedLayout(2, 2, good.key_index, shifted).check_integrity()
    with pytest.raises(AssertionError):
        PagedLayout(2, 2, good.key_index, good.key_index).check_integrity()  # keys and values overlap


def test_cache_shape_is_checked() -> None:
    layout = learn_layout(write_transposed_keys, 4, 8, torch.float32)
    check_cache_shape(torch.zeros(3, 2, 4, 16), layout)
    for shape in ((3, 2, 4, 8), (3, 2, 8, 16), (2, 3, 2, 4, 16)):
        with pytest.raises(UnsupportedLayout):
            read_tokens(torch.zeros(shape), torch.tensor([0]), layout)


def test_read_tokens_from_a_strided_cache_view() -> None:
    """The same tokens read from a non-contiguous view of the cache (the fallback path)."""
    bs, d, heads = 4, 8, 2
    layout = learn_layout(write_transposed_keys, bs, d, torch.float32)
    big = torch.zeros(heads, 5, bs, 2 * d)  # heads outermost in memory
    cache = big.transpose(0, 1)  # [blocks, H, bs, 2D], not contiguous
    assert not cache.is_contiguous()
    slots = torch.tensor([6, 0, 19, 13])
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, heads, d, generator=g), torch.randn(4, heads, d, generator=g)
    contiguous = cache.contiguous()  # the fake writes through .view: write a copy, then copy it in
    write_transposed_keys(k, v, contiguous, slots)
    cache.copy_(contiguous)
    rk, rv = read_tokens(cache, slots, layout)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert all(torch.equal(a, b) for a, b in zip(read_tokens(contiguous, slots, layout), (rk, rv), strict=True))
