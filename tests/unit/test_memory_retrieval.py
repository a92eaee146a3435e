"""top_k (cosine, stable ties) and order_for_layout."""

from dataclasses import dataclass

import numpy as np
import pytest

from memory_store.embedder import HashingEmbedder
from memory_store.retrieval import Scored, order_for_layout, top_k


def test_top_k_by_cosine():
    m = np.array([[1, 0], [0, 1], [3, 3], [-1, 0]], dtype=np.float32)
    got = top_k(np.array([2.0, 0.0]), ["x", "y", "diag", "neg"], m, 3)
    assert [s.fact_id for s in got] == ["x", "diag", "y"]
    assert got[0] == Scored("x", 1.0) and got[1].score == pytest.approx(2**-0.5)
    assert [s.fact_id for s in top_k(np.array([1.0, 0]), ["x", "y", "diag", "neg"], m, 10)][-1] == "neg"


def test_ties_keep_input_order_and_zero_rows_score_zero():
    m = np.array([[0, 1], [1, 0], [0, 0], [1, 0], [1, 0]], dtype=np.float32)
    got = top_k(np.array([1.0, 0.0]), ["p", "q", "zero", "r", "s"], m, 5)
    assert [s.fact_id for s in got] == ["q", "r", "s", "p", "zero"]
    assert got[-1].score == 0.0 and got[-2].score == 0.0


def test_edge_cases():
    assert top_k(np.ones(3), [], np.zeros((0, 3)), 5) == []
    assert top_k(np.ones(2), ["a"], np.ones((1, 2)), 0) == []
    with pytest.raises(ValueError, match="shape"):
        top_k(np.ones(2), ["a", "b"], np.ones((1, 2)), 1)
    with pytest.raises(ValueError, match="k"):
        top_k(np.ones(2), ["a"], np.ones((1, 2)), -1)
    with pytest.raises(ValueError, match="zero"):
        top_k(np.zeros(2), ["a"], np.ones((1, 2)), 1)


def test_with_hashing_embedder_shared_words_win():
    e = HashingEmbedder()
    texts = ["Alice adopted a dog named Rex", "The tax office is closed", "Bob plays chess"]
    got = top_k(e.embed(["alice's dog rex"])[0], ["d", "t", "c"], e.embed(texts), 1)
    assert got[0].fact_id == "d" and got[0].score > 0.5


@dataclass(frozen=True)
class F:
    id: str
    source: str
    seq: int


def test_order_for_layout_groups_sources_in_seq_order():
    ranked = [F("b3", "b", 3), F("a7", "a", 7), F("b1", "b", 1), F("a2", "a", 2), F("b2", "b", 2)]
    assert [f.id for f in order_for_layout(ranked)] == ["a2", "a7", "b1", "b2", "b3"]
    assert order_for_layout([]) == []


def test_many_ties_are_stable():
    rng = np.random.default_rng(0)
    m = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 200)]  # 200 rows, three distinct scores
    ids = [f"f{i}" for i in range(200)]
    got = [s.fact_id for s in top_k(np.array([1.0, 0.5, 0.0]), ids, m, 200)]
    expected = sorted(ids, key=lambda i: (-float(m[int(i[1:])] @ [1.0, 0.5, 0.0]), int(i[1:])))
    assert got == expected
