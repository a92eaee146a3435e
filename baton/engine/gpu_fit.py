"""Does an engine fit its GPU? Weights, KV budget and a fixed overhead against device memory.

    per GPU:  weights / tensor_parallel + kv_cache_gib + OVERHEAD_GIB  <=  device memory

Baton gives vLLM its KV pool as `kv_cache_memory_bytes` (kv_cache_gib), which vLLM takes instead
of sizing the pool from `gpu_memory_utilization`; what is left of the device must hold the
weights (each tensor-parallel rank holds 1/tp of them) and vLLM's own working memory —
activations, CUDA graphs, the CUDA context — budgeted here as OVERHEAD_GIB, a round figure
rather than a measurement (vLLM's profiling run reports it per model; it grows with
max_num_batched_tokens).

Device memory by Ray accelerator type, from the vendors' spec sheets (GiB as marketed in GB is
rounded down, so the check errs on the safe side).
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
GB = 10**9
OVERHEAD_GIB = 4.0

# NVIDIA's data sheets, in GB: H100 SXM/PCIe 80, H200 141, A100 80 GB model, L40S 48, L4 24, B200 180
DEVICE_MEMORY_GB: dict[str, float] = {"H100": 80, "H200": 141, "A100": 80, "L40S": 48, "L4": 24, "B200": 180}


@dataclass(frozen=True)
class GpuFit:
    """One engine's memory per GPU, in GiB; `fits` when need <= device."""

    weights_gib: float  # per GPU (weights / tensor_parallel)
    kv_gib: float
    overhead_gib: float
    device_gib: float

    @property
    def need_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.overhead_gib

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.device_gib

    def describe(self) -> str:
        return (f"{self.weights_gib:.1f} GiB of weights + {self.kv_gib:.1f} GiB of KV + {self.overhead_gib:.1f} GiB of working memory "
                f"= {self.need_gib:.1f} GiB per GPU, of {self.device_gib:.1f} GiB")


def gpu_fit(weight_bytes: float, kv_cache_gib: float, accelerator_type: str, tensor_parallel: int = 1,
            overhead_gib: float = OVERHEAD_GIB) -> GpuFit:
    """Raises KeyError for an accelerator type without a known memory size, ValueError for a
    tensor parallel size below 1."""
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if accelerator_type not in DEVICE_MEMORY_GB:
        raise KeyError(f"no device memory known for accelerator type {accelerator_type!r} (known: {', '.join(DEVICE_MEMORY_GB)})")
    return GpuFit(weights_gib=weight_bytes / tensor_parallel / GIB, kv_gib=kv_cache_gib, overhead_gib=overhead_gib,
                  device_gib=DEVICE_MEMORY_GB[accelerator_type] * GB / GIB)
