"""The hybrid P/D phase of `baton bench checkpoints`: tiny LFM2 under ConServe, as
`serve run cluster_configs/local_hybrid_pd.yaml` starts it (DP checkpoints on the decoder).

Each prompt is the first turn of its own conversation: prefilled on the prefill engine, its
attention KV and conv state read by the decoder over NIXL (docs/hybrid_pd.md,
kv_transfer/short_conv.py), decoded there greedily. The reference is the same prompts on one
fresh engine of the same model and dtype with prefix caching off (no transfer, no cache):
`hybrid_pd_exact` is true only when every prompt's greedy text is the reference's. Then every
conversation sends a second turn, which must stay on its decoder without another transfer.
"""
from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from baton.bench.checkpoint_engine import TINY_HYBRID, run_engine
from baton.bench.cluster import LocalServeApp, settled_transfers
from baton.paths import REPO_ROOT

CONFIG = REPO_ROOT / "cluster_configs" / "local_hybrid_pd.yaml"
HTTP_PORT, RAY_PORT = 28720, 26720
RESOURCES = {"prefill_slot": 1, "decode_slot": 1}
MAX_MODEL_LEN = 4096


def app_args(state_dir: Path) -> dict[str, Any]:
    """The shipped config's application args, with its conversation database under state_dir."""
    args = copy.deepcopy(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    args["model_cache"] = str(REPO_ROOT / ".cache" / "models")
    args["routing"] = {**args["routing"], "ownership_db_path": str(state_dir / "conversations.sqlite3")}
    return args


def _complete(url: str, session: str, ids: list[int], max_tokens: int) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                   headers={"x-session-id": session}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"hybrid P/D turn of {session} failed: HTTP {r.status_code} {r.text[:300]}")
    return r.json()["choices"][0]["text"], r.headers.get("x-baton-replica", ""), time.perf_counter() - t0


def hybrid_pd_phase(prompts: list[list[int]], max_tokens: int, log_dir: Path) -> dict[str, Any]:
    """Run the phase; returns per-prompt rows and the verdicts (exact, one handoff each, pinned)."""
    from transformers import AutoTokenizer

    prompts = [p for p in prompts if len(p) + 2 * max_tokens + 16 <= MAX_MODEL_LEN]
    if not prompts:
        raise ValueError(f"no prompt fits the hybrid P/D config's max_model_len {MAX_MODEL_LEN}")
    tok = AutoTokenizer.from_pretrained(str(TINY_HYBRID))
    dtype = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]["prefill"]["engine"]["dtype"]
    ref = run_engine("nocache", prompts, max_tokens=max_tokens, max_model_len=MAX_MODEL_LEN, dtype=dtype)
    ref_texts = [tok.decode(row["tokens"], skip_special_tokens=True) for row in ref["rows"]]
    rows: list[dict[str, Any]] = []
    state = Path(tempfile.mkdtemp(prefix="baton-bench-hybrid-pd-"))
    with LocalServeApp(app_args(state), resources=RESOURCES, http_port=HTTP_PORT, ray_port=RAY_PORT, log_dir=log_dir) as app:
        before = settled_transfers(app.url)
        for i, ids in enumerate(prompts):
            text, replica, wall = _complete(app.url, f"ckpt-pd-{i}", ids, max_tokens)
            rows.append({"prompt_tokens": len(ids), "exact": text == ref_texts[i], "replica": replica, "first_turn_s": round(wall, 4)})
        first_turn_transfers = settled_transfers(app.url) - before
        for i, ids in enumerate(prompts):
            follow = ids + tok.encode(ref_texts[i] + "\nAnd then?", add_special_tokens=False)
            _, replica, wall = _complete(app.url, f"ckpt-pd-{i}", follow, max_tokens)
            rows[i].update(second_replica=replica, second_turn_s=round(wall, 4))
        total_transfers = settled_transfers(app.url) - before
    n = len(prompts)
    return {
        "config": str(CONFIG.relative_to(REPO_ROOT)), "dtype": dtype, "requests": n, "max_tokens": max_tokens, "rows": rows,
        "exact": all(r["exact"] for r in rows),
        "first_turn_transfers": first_turn_transfers, "total_transfers": total_transfers,
        "one_handoff_each": first_turn_transfers == n and total_transfers == n,
        "pinned": all(r["second_replica"] == r["replica"] for r in rows),
    }
