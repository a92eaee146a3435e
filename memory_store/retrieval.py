"""Pure retrieval policy: which facts (top_k) and in what order they are laid out
(order_for_layout). No database, no model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np


@dataclass(frozen=True)
class Scored:
    fact_id: str
    score: float  # cosine similarity in [-1, 1]


def top_k(query_vec: np.ndarray, ids: Sequence[str], matrix: np.ndarray, k: int) -> list[Scored]:
    """The k ids whose rows are most cosine-similar to query_vec, best first. Ties keep the
    order of `ids` (earlier first), so equal inputs always give equal answers. Zero rows score 0.
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    q = np.asarray(query_vec, dtype=np.float32).reshape(-1)
    m = np.asarray(matrix, dtype=np.float32)
    if m.ndim != 2 or m.shape[0] != len(ids) or (len(ids) and m.shape[1] != q.shape[0]):
        raise ValueError(f"matrix shape {m.shape} does not match {len(ids)} ids of width {q.shape[0]}")
    if k == 0 or not len(ids):
        return []
    q_norm = float(np.linalg.norm(q))
    if q_norm == 0:
        raise ValueError("query vector is zero")
    row_norms = np.linalg.norm(m, axis=1)
    scores = (m @ q) / (np.where(row_norms == 0, 1.0, row_norms) * q_norm)  # [n]
    # lexsort: last key is primary -> by score descending, then by position ascending
    order = np.lexsort((np.arange(len(ids)), -scores))[:k]
    return [Scored(ids[i], float(scores[i])) for i in order]


class Sequenced(Protocol):
    @property
    def source(self) -> str: ...

    @property
    def seq(self) -> int: ...


S = TypeVar("S", bound=Sequenced)


def order_for_layout(facts: Sequence[S]) -> list[S]:
    """Facts in (source, seq) order: a source's facts sit together in their original order, so a
    fact's encoded context (its w predecessors) is often the segment just before it."""
    return sorted(facts, key=lambda f: (f.source, f.seq))
