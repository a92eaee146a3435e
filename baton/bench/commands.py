"""`baton bench <name> [--quick]` (registered by baton/cli.py)."""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
from pathlib import Path
from typing import Any

BENCHMARKS = {
    "overhead": "baton.bench.overhead",  # Baton vs bare vLLM, same engine and prompts
    "conserve": "baton.bench.conserve",  # routing policies on one agentic trace
    "salting": "baton.bench.salting",  # prefix-cache isolation: tenant vs shared salts on the agentic trace
    "checkpoints": "baton.bench.checkpoints",  # recurrent-state checkpoint placement (hybrid models)
    "memory": "baton.bench.memory",  # InferScale: KV vs prompt injection of memories on LoCoMo
    "reliability": "baton.bench.reliability",  # faults, overload, bad input, isolation (+ soak)
    "admission": "baton.bench.reliability_admission",  # chat admission under overload: fixed bound vs adaptive (TTFT target)
    "realtime": "baton.bench.realtime",  # Metronome: bounded vs unbounded real-time sessions, cliff, AIMD
    "window-quality": "baton.bench.window_quality",  # Metronome: sink + window KV perplexity and repetition
    "api": "baton.bench.api",  # tool calling round trip, gRPC vs HTTP on one trace (ABBA), gRPC realtime
    "scale": "baton.bench.scale",  # fleet projection: the router's policies on simulated 8-512 GPU fleets (no engine)
    "control": "baton.bench.control",  # the control plane at 8-128 stand-in replicas: routing decisions/s, directory p99, memory
    "multinode": "baton.bench.multinode",  # a two-node Ray cluster: cross-node NIXL handoffs, a worker node killed under live turns
    "directory": "baton.bench.directory",  # the conversation directory's own CPU per routing decision, by fleet size and live pins (no Ray)
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark: prints figures, writes JSON + PNG, ends with a RESULT line")
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="the same code on a smaller workload (<= 10 min here)")
    p.add_argument("--offline", action="store_true", help="checkpoints only: the simulator part, no engine")
    p.add_argument("--calibrate", type=Path, default=None, help="scale only: a `bench conserve` conserve.json to calibrate against")
    p.add_argument("--cpu-steps", type=Path, default=None, help="scale only: CPU engine step times (python -m baton.sim.cpu_steps)")
    p.add_argument("--served-steps", type=Path, default=None,
                   help="scale only: a `bench conserve` run dir whose engines' step traces time the calibration (instead of --cpu-steps)")
    p.add_argument("--replicas-json", type=Path, default=None, help="scale only: the control-plane measurement ({\"max_replicas\": n})")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default=None,
                   help="memory and window-quality only: the model's dtype (default auto: bfloat16 where the CPU computes it natively, else float32)")
    p.add_argument("--fidelity-only", action="store_true",
                   help="memory only: only the fidelity phase (top-1 agreement and KL against prompt injection), no timings")
    p.add_argument("--rates", type=_rates, default=None,
                   help="conserve only: the load levels, conversations/s, comma-separated and increasing (default: the mode's; "
                        "size them to the host: a slower CPU prefills a first turn in seconds)")
    p.add_argument("--ttft-slo", type=_positive, default=None,
                   help="conserve only: the p95 TTFT (s) colocated must meet at the headline level (default 3)")
    p.add_argument("--variants", default=None,
                   help="control only: the variants to run, comma-separated, of no_pin_cache, pin_cache, throughput_optimized "
                        "(the default: these three), sharded_directory and sharded_relay")
    p.add_argument("--out", type=Path, default=None, help="output dir (default ./runs/bench-<name>-<timestamp>, relative to where you run it)")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    import importlib

    # resolved here, once: benches hand paths to `serve run`, whose working directory is the checkout
    out = (args.out or Path("runs") / f"bench-{args.name}-{dt.datetime.now():%Y%m%d-%H%M%S}").resolve()
    extra = {}
    if getattr(args, "offline", False):
        if args.name != "checkpoints":
            raise SystemExit("--offline is only for `baton bench checkpoints`")
        extra["offline"] = True
    if getattr(args, "dtype", None) is not None:
        if args.name not in ("memory", "window-quality"):
            raise SystemExit("--dtype is only for `baton bench memory` and `baton bench window-quality`")
        extra["dtype"] = args.dtype
    if getattr(args, "fidelity_only", False):
        if args.name != "memory":
            raise SystemExit("--fidelity-only is only for `baton bench memory`")
        extra["fidelity_only"] = True
    conserve_only = {kw: v for arg, kw in (("rates", "rates"), ("ttft_slo", "ttft_slo_s")) if (v := getattr(args, arg, None)) is not None}
    if conserve_only:
        if args.name != "conserve":
            raise SystemExit("--rates and --ttft-slo are only for `baton bench conserve`")
        extra.update(conserve_only)
    if getattr(args, "variants", None) is not None:
        if args.name != "control":
            raise SystemExit("--variants is only for `baton bench control`")
        from baton.bench.control_config import pick_variants

        try:
            pick_variants(args.variants)
        except ValueError as e:
            raise SystemExit(f"--variants: {e}") from None
        extra["variants"] = args.variants
    scale_only = {k: getattr(args, k, None) for k in ("calibrate", "cpu_steps", "served_steps", "replicas_json")}
    if any(v is not None for v in scale_only.values()):
        if args.name != "scale":
            raise SystemExit("--calibrate, --cpu-steps, --served-steps and --replicas-json are only for `baton bench scale`")
        sources = sum(scale_only[k] is not None for k in ("cpu_steps", "served_steps"))
        if (scale_only["calibrate"] is not None) != (sources == 1) or sources > 1:
            raise SystemExit("--calibrate takes exactly one of --cpu-steps or --served-steps")
        extra.update({k: v for k, v in scale_only.items() if v is not None})
    importlib.import_module(BENCHMARKS[args.name]).run(quick=args.quick, out_dir=out, **extra)
    return 0


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def _rates(text: str) -> tuple[float, ...]:
    """`0.05,0.15`: load levels in conversations/s, each > 0, strictly increasing (light to saturating)."""
    rates = tuple(_positive(part.strip()) for part in text.split(","))
    if any(b <= a for a, b in itertools.pairwise(rates)):
        raise argparse.ArgumentTypeError(f"rates must increase, got {text!r}")
    return rates
