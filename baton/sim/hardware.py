"""The hardware of a projected fleet: GPUs, the model, the links, and the pool layouts.

Model: Llama-3.1-8B (AIConfigurator's meta-llama/Meta-Llama-3.1-8B), bf16, TP 1, one engine per
GPU. KV bytes per token from its config (baton/engine/simulated/geometry.py: 2 × 32 layers × 8 KV
heads × 128 × 2 B = 128 KiB).
KV pools (assumed, vLLM gpu_memory_utilization 0.9 less 16 GB weights and activations):
H200 141 GB -> 100 GiB; L40S 48 GB -> 22 GiB.
Links (published figures; the pools sit on different nodes, so handoffs cross the network, not
NVLink): H200 nodes: one 400 Gbit/s InfiniBand NDR port per GPU (ConnectX-7, as in DGX H200);
L40S nodes: 200 Gbit/s per GPU (PCIe Gen4 servers, ConnectX-7 at 200G) — a handoff between an
H200 and an L40S runs at the slower end, 200 Gbit/s. (NVLink 4 would be 900 GB/s per GPU
within a node; not used.) Real-time window re-injection is a copy inside the GPU at half its
HBM bandwidth (read + write): H200 4.8 TB/s -> 19,200 Gbit/s; L40S 864 GB/s -> 3,456 Gbit/s.
Blocks: 128 tokens (vLLM's GPU default is 16): 512 engines' block tables must fit this machine's
memory; a prefix hit then loses at most 127 tokens instead of 15.
Layout: disaggregated policies give PREFILL_FRACTION of the GPUs to the prefill pool (at least
one) and the rest to the decode pool; colocated runs every GPU as a unified engine (the same
GPUs: in the heterogeneous fleet, the same H200s and L40Ss).
"""
from __future__ import annotations

from typing import Literal

from baton.sim.engine import EngineShape
from baton.sim.fleet import PoolSpec

MODEL = "meta-llama/Meta-Llama-3.1-8B"
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
GIB = 1 << 30
KV_GIB = {"h200_sxm": 100.0, "l40s": 22.0}
LINK_GBPS = {"h200_sxm": 400.0, "l40s": 200.0}
INJECT_GBPS = {"h200_sxm": 19_200.0, "l40s": 3_456.0}
BLOCK_SIZE = 128
PREFILL_FRACTION = 0.25

Tiers = Literal["homo", "hetero"]
TIERS: tuple[Tiers, ...] = ("homo", "hetero")


def shape(gpu: str, peer: str | None = None) -> EngineShape:
    """An engine on `gpu`; `peer`: the GPU on the other side of its handoffs (the slower link wins)."""
    link = min(LINK_GBPS[gpu], LINK_GBPS[peer or gpu])
    return EngineShape(gpu=gpu, kv_capacity_tokens=int(KV_GIB[gpu] * GIB) // KV_BYTES_PER_TOKEN,
                       bytes_per_token=KV_BYTES_PER_TOKEN, link_gbps=link, inject_gbps=INJECT_GBPS[gpu], block_size=BLOCK_SIZE)


def split(gpus: int) -> tuple[int, int]:
    """(prefill, decode) GPUs of a disaggregated layout."""
    if gpus < 2:
        raise ValueError("a disaggregated fleet needs at least 2 GPUs")
    prefill = max(1, round(gpus * PREFILL_FRACTION))
    return prefill, gpus - prefill


def pools(gpus: int, tiers: Tiers, disaggregated: bool) -> list[PoolSpec]:
    prefill, decode = split(gpus)
    p_gpu, d_gpu = ("h200_sxm", "h200_sxm") if tiers == "homo" else ("h200_sxm", "l40s")
    if disaggregated:
        return [PoolSpec("prefill", prefill, shape(p_gpu, d_gpu)), PoolSpec("decode", decode, shape(d_gpu, p_gpu))]
    if tiers == "homo":
        return [PoolSpec("decode", gpus, shape(p_gpu))]
    return [PoolSpec("decode", prefill, shape(p_gpu, d_gpu)), PoolSpec("decode", decode, shape(d_gpu, p_gpu))]
