"""The ConServe handoff for real, without Ray: a prefill engine (process P) and a decode engine
(process D), each an EngineRunner on SmolLM2 with the counting NIXL connector, in two spawned
processes. P prefills one conversation turn (do_remote_decode); D decodes it from the KV it pulls
over NIXL, and its connector's ledger says exactly what moved.

One module fixture runs the whole scenario once (~1 min on 2 idle cores) and keeps what each step
returned; every test checks one claim about it.

    P: prefill, max_tokens=1, do_remote_decode -> kv_transfer_params
    D: decode with those kv_transfer_params    -> D's ledger: 1 request, every prompt block
    P: local run of the same prompt            -> the same greedy tokens as D
    D: turn 2 = turn-1 prompt + reply + user   -> no new transfer; D's own prefix cache hits
    D: another prompt, kv_transfer_params of an engine that is gone -> a counted failure, and the
       request still succeeds (kv_load_failure_policy "recompute")

Why the local run comes after the prefill: D loads the KV of all N prompt tokens and recomputes
only the last one (one query over N-1 cached positions). A cold local run computes that token
inside one N-token prefill instead, a different attention path whose bf16 rounding flips a
near-tie a few tokens later. The prompt is 1 token longer than a whole number of blocks, so P's
local run hits its prefix cache for exactly N-1 tokens and takes D's path on P's own KV: equal
outputs then mean D received that KV exactly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from baton.engine.types import GenerationRequest, SamplingSpec
from kv_transfer.ledger import TransferRecord, TransferTotals

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
BLOCK = 128  # vLLM's CPU KV block size
SMOLLM2_ELEMENTS_PER_TOKEN = 11_520  # 30 layers × 3 KV heads × 64 dims × (K, V)


def smollm2_bytes_per_token() -> int:
    """KV bytes per token of the engines here: dtype auto is bf16 (2 bytes) on a CPU that computes it
    natively, else float32 (4 bytes): 23,040 or 46,080 (baton/engine/args.engine_dtype)."""
    from baton.engine.vllm_engine import native_cpu_bf16

    return SMOLLM2_ELEMENTS_PER_TOKEN * (2 if native_cpu_bf16() else 4)
REPLY_TOKENS = 16
START_TIMEOUT_S = 300.0  # an idle 2-core machine needs ~20 s; generous for a loaded one
CALL_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0

SYSTEM = "You are a travel assistant. Available tools: " + " ".join(
    f"tool_{i}(city: str, date: str) returns the weather, flights and hotels for a city on a date." for i in range(16)
)
OTHER_SYSTEM = "You are a museum guide. Collections: " + " ".join(
    f"room_{i} holds paintings, sculptures and maps from century {i} with notes for visitors." for i in range(16)
)
QUESTION = "Describe Paris for a first-time visitor in three sentences."
FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nAnd what should I see in Berlin?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_BLOCKS = 3  # full blocks before the prompt's last token: N = 3 × 128 + 1 = 385 tokens


# ---- the engine process (spawned: imports vLLM only here) -------------------------------------
def _engine_process(conn: Connection, role: str, trace_dir: str) -> None:
    """Build one engine with the counting NIXL connector, then answer commands until 'stop'."""
    try:
        from baton.engine.args import build_engine_spec
        from baton.engine.config import EngineConfig
        from baton.engine.runner import EngineRunner
        from kv_transfer.ledger import process_ledger
        from kv_transfer.nixl import nixl_kv_transfer_config, side_channel_env

        cfg = EngineConfig(model=str(MODEL_DIR), max_model_len=2048, kv_cache_gib=0.25, max_num_seqs=4, step_trace_dir=trace_dir)
        spec = build_engine_spec(
            cfg, role=role, handoff=False, model_path=str(MODEL_DIR), on_gpu=False, cache_root=str(ROOT / ".cache")  # type: ignore[arg-type]
        )
        kv_role = "kv_producer" if role == "prefill" else "kv_both"
        spec = dataclasses.replace(
            spec,
            engine_kwargs={**spec.engine_kwargs, "kv_transfer_config": nixl_kv_transfer_config(kv_role, "cpu")},
            env={**spec.env, **side_channel_env()},  # before the engine is built: vLLM caches its env then
        )
        process_cpus = sorted(os.sched_getaffinity(0))
        runner = EngineRunner(spec)
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", process_cpus))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "generate":
                reply: Any = asyncio.run(_collect(runner, arg))
            elif cmd == "ledger":
                process_ledger().check_integrity()
                reply = (process_ledger().totals(), process_ledger().records())
            elif cmd == "thread_load":
                reply = _thread_load()
            elif cmd == "engine_thread_cpus":
                engine_thread = next(t for t in threading.enumerate() if t.name == "baton-engine")
                reply = sorted(os.sched_getaffinity(engine_thread.native_id or 0))
            elif cmd == "stop":
                runner.shutdown()
                conn.send(("ok", None))
                os._exit(0)  # at once: vLLM's and NIXL's background threads can delay a normal exit
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", reply))


def _thread_load(window_s: float = 1.0) -> dict[int, tuple[float, int]]:
    """Per thread of this process: (share of a core it used over the window, its nice value)."""

    def ticks() -> dict[int, tuple[int, int]]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[16]))  # utime+stime, nice
        return out

    before = ticks()
    time.sleep(window_s)
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    return {t: ((a[0] - before[t][0]) / hz / window_s, a[1]) for t, a in after.items() if t in before}


async def _collect(runner: Any, req: GenerationRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": (), "text": "", "cached_tokens": 0, "kv_transfer_params": None}
    t0 = time.monotonic()
    async for d in runner.generate(req):
        out["token_ids"] += d.token_ids
        out["text"] += d.text
        out["cached_tokens"] = max(out["cached_tokens"], d.cached_tokens)
        out["kv_transfer_params"] = d.kv_transfer_params or out["kv_transfer_params"]
    out["seconds"] = time.monotonic() - t0
    return out


# ---- the parent's handle on one engine process ------------------------------------------------
class EngineProcess:
    def __init__(self, role: str, trace_dir: Path):
        ctx = mp.get_context("spawn")
        self.role = role
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process, args=(child, role, str(trace_dir)), name=f"nixl-{role}", daemon=True)
        self._proc.start()
        child.close()
        self.process_cpus: list[int] = []

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.process_cpus = self._answer("start", timeout)

    def call(self, cmd: str, arg: Any = None, timeout: float = CALL_TIMEOUT_S) -> Any:
        self._conn.send((cmd, arg))
        return self._answer(cmd, timeout)

    def generate(self, req: GenerationRequest) -> dict[str, Any]:
        return self.call("generate", req)

    def ledger(self) -> tuple[TransferTotals, tuple[TransferRecord, ...]]:
        return self.call("ledger")

    def _answer(self, what: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.role} engine: no answer to {what!r} within {timeout:.0f}s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"{self.role} engine process died (exit code {self._proc.exitcode}) before answering {what!r}") from None
        if status != "ok":
            raise RuntimeError(f"{self.role} engine failed on {what!r}:\n{value}")
        return value

    def stop(self) -> None:
        """Ask the child to stop; whatever happens, it is gone when this returns."""
        try:
            if self._proc.is_alive():
                self._conn.send(("stop", None))
                self._conn.poll(STOP_TIMEOUT_S)
        except (OSError, EOFError):
            pass
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


# ---- the scenario ----------------------------------------------------------------------------
@dataclasses.dataclass
class Handoff:
    prompt_ids: tuple[int, ...]
    local: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    d_after_decode: TransferTotals
    d_records: tuple[TransferRecord, ...]
    turn2_ids: tuple[int, ...]
    turn2: dict[str, Any]
    d_after_turn2: TransferTotals
    fallback: dict[str, Any]
    d_after_failure: TransferTotals
    d_records_after_failure: tuple[TransferRecord, ...]
    p_before_next_request: TransferTotals
    p_after: TransferTotals
    p_records: tuple[TransferRecord, ...]
    engine_thread_cpus: dict[str, list[int]]
    idle_thread_load: dict[str, dict[int, tuple[float, int]]]
    process_cpus: dict[str, list[int]]
    step_traces: dict[str, list[dict[str, Any]]]  # role -> its engine's step trace (header first), read after stop


def _chat_prompts() -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Token ids of turn 1 (system + question + assistant header, PROMPT_BLOCKS × BLOCK + 1 tokens:
    the system text is cut to fit), of the turn-2 suffix (end of the assistant turn, the follow-up
    question, the next assistant header), and of a turn 1 with another system text (no common
    prefix). Same ids as the ChatML template gives."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    head, tail = ids("<|im_start|>system\n"), ids(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    room = PROMPT_BLOCKS * BLOCK + 1 - len(head) - len(tail)
    return head + ids(SYSTEM)[:room] + tail, ids(FOLLOW_UP), head + ids(OTHER_SYSTEM)[:room] + tail


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nobody listens there once the socket is closed


@pytest.fixture(scope="module")
def handoff(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup` (scripts/setup.sh)")
    trace_dir = tmp_path_factory.mktemp("step-trace")
    engines = {role: EngineProcess(role, trace_dir) for role in ("prefill", "decode")}  # both start at once
    try:
        prompt, follow_up, other_prompt = _chat_prompts()
        for e in engines.values():
            e.wait_ready()
        p, d = engines["prefill"], engines["decode"]
        greedy = SamplingSpec(max_tokens=REPLY_TOKENS, temperature=0.0)

        prefill = p.generate(
            GenerationRequest("turn1-prefill", prompt, SamplingSpec(max_tokens=1, temperature=0.0),
                              kv_transfer_params={"do_remote_decode": True})
        )
        decode = d.generate(GenerationRequest("turn1-decode", prompt, greedy, kv_transfer_params=prefill["kv_transfer_params"]))
        d_after_decode, d_records = d.ledger()

        p_before_next_request = _settled_producer_ledger(p)
        local = p.generate(GenerationRequest("local-run", prompt, greedy))  # no transfer
        p_after, p_records = p.ledger()

        turn2_ids = prompt + tuple(decode["token_ids"]) + follow_up
        turn2 = d.generate(GenerationRequest("turn2", turn2_ids, greedy))
        d_after_turn2, _ = d.ledger()

        gone = {**prefill["kv_transfer_params"], "remote_engine_id": "engine-that-is-gone",
                "remote_request_id": "gone-1", "remote_port": _closed_port()}
        fallback = d.generate(GenerationRequest("from-gone-engine", other_prompt, greedy, kv_transfer_params=gone))
        d_after_failure, d_records_after_failure = d.ledger()

        result = dict(
            prompt_ids=prompt, local=local, prefill=prefill, decode=decode,
            d_after_decode=d_after_decode, d_records=d_records,
            turn2_ids=turn2_ids, turn2=turn2, d_after_turn2=d_after_turn2,
            fallback=fallback, d_after_failure=d_after_failure, d_records_after_failure=d_records_after_failure,
            p_before_next_request=p_before_next_request, p_after=p_after, p_records=p_records,
            engine_thread_cpus={role: e.call("engine_thread_cpus") for role, e in engines.items()},
            idle_thread_load={role: e.call("thread_load") for role, e in engines.items()},
            process_cpus={role: e.process_cpus for role, e in engines.items()},
        )
    finally:
        for e in engines.values():
            e.stop()
    traces = {role: [json.loads(line) for f in sorted(trace_dir.glob(f"{role}-*.jsonl")) for line in f.read_text().splitlines()]
              for role in engines}
    yield Handoff(**result, step_traces=traces)


def _settled_producer_ledger(p: EngineProcess, wait_s: float = 3.0) -> TransferTotals:
    """P's ledger once D's read notification had time to arrive (P gets no new request meanwhile)."""
    deadline = time.monotonic() + wait_s
    totals, _ = p.ledger()
    while totals.requests_sent == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        totals, _ = p.ledger()
    return totals


# ---- claims ----------------------------------------------------------------------------------
def test_the_prompt_spans_more_than_two_kv_blocks(handoff: Handoff) -> None:
    assert len(handoff.prompt_ids) == PROMPT_BLOCKS * BLOCK + 1 > 256


def test_decode_from_pulled_kv_equals_a_local_run(handoff: Handoff) -> None:
    assert len(handoff.local["token_ids"]) == REPLY_TOKENS
    assert handoff.local["cached_tokens"] == len(handoff.prompt_ids) - 1  # the path D takes (see top)
    assert handoff.decode["token_ids"] == handoff.local["token_ids"], (handoff.decode["text"], handoff.local["text"])


def test_the_prefill_returns_plain_kv_transfer_params(handoff: Handoff) -> None:
    params = handoff.prefill["kv_transfer_params"]
    assert isinstance(params, dict) and params["do_remote_prefill"] is True
    assert params["remote_host"] == "127.0.0.1" and int(params["remote_port"]) > 0
    assert len(params["remote_block_ids"][0]) == -(-len(handoff.prompt_ids) // BLOCK)


def test_the_decode_ledger_counts_exactly_one_transfer_of_every_prompt_block(handoff: Handoff) -> None:
    t = handoff.d_after_decode
    blocks = -(-len(handoff.prompt_ids) // BLOCK)  # the last, partial block moves too
    assert t.bytes_per_block == BLOCK * smollm2_bytes_per_token()
    assert (t.requests_received, t.blocks_received, t.failures, t.receives_pending) == (1, blocks, 0, 0)
    assert t.bytes_received == blocks * t.bytes_per_block > 0
    assert t.nixl_bytes_read == t.bytes_received  # NIXL's own telemetry agrees
    [rec] = handoff.d_records
    assert (rec.kind, rec.blocks, rec.bytes) == ("received", blocks, t.bytes_received)
    assert rec.request_id.startswith("turn1-decode-")  # vLLM's internal id: ours + "-" + 8 hex digits
    assert rec.peer_engine_id == handoff.prefill["kv_transfer_params"]["remote_engine_id"]
    assert (t.requests_offered, t.requests_sent) == (0, 0)  # D held nothing for anyone


def test_the_second_turn_hits_the_decode_prefix_cache_without_a_transfer(handoff: Handoff) -> None:
    assert handoff.d_after_turn2 == handoff.d_after_decode
    # a request without kv_transfer_params reports D's own prefix-cache hits
    assert handoff.turn2["cached_tokens"] >= (len(handoff.prompt_ids) // BLOCK) * BLOCK
    assert handoff.turn2["cached_tokens"] % BLOCK == 0
    assert len(handoff.turn2["token_ids"]) == REPLY_TOKENS


def test_a_pull_from_a_gone_engine_is_counted_as_a_failure_and_recomputed(handoff: Handoff) -> None:
    assert len(handoff.fallback["token_ids"]) == REPLY_TOKENS  # the request still succeeds
    t, before = handoff.d_after_failure, handoff.d_after_turn2
    assert (t.failures, t.requests_received, t.blocks_received, t.receives_pending) == (1, 1, before.blocks_received, 0)
    rec = handoff.d_records_after_failure[-1]
    assert (rec.kind, rec.blocks, rec.bytes, rec.peer_engine_id) == ("failed", 0, 0, "engine-that-is-gone")
    assert rec.request_id.startswith("from-gone-engine-")


def test_the_prefill_ledger_counts_one_offer_served_to_the_decoder(handoff: Handoff) -> None:
    t = handoff.p_after
    blocks = -(-len(handoff.prompt_ids) // BLOCK)
    assert (t.requests_offered, t.blocks_offered, t.requests_sent, t.leases_expired) == (1, blocks, 1, 0)
    assert (t.requests_received, t.failures) == (0, 0)
    [rec] = handoff.p_records
    assert (rec.kind, rec.blocks) == ("sent", blocks) and rec.request_id.startswith("turn1-prefill-")


def test_nixl_threads_that_poll_without_pause_yield_to_the_engine(handoff: Handoff) -> None:
    """NIXL's progress thread polls with no pause, a full core per engine even when idle; the
    connector lowers NIXL's threads to nice 19 so the forward passes keep their cores."""
    for role, load in handoff.idle_thread_load.items():
        assert any(nice == 19 for _, nice in load.values()), (role, load)
        pollers = {tid: (share, nice) for tid, (share, nice) in load.items() if share > 0.5}  # engines are idle now
        assert all(nice == 19 for _, nice in pollers.values()), (role, pollers)


def test_the_prefill_engine_releases_served_kv_without_a_new_request(handoff: Handoff) -> None:
    assert handoff.p_before_next_request.requests_sent == 1


def test_the_engine_thread_may_use_every_core_of_its_process(handoff: Handoff) -> None:
    for role in ("prefill", "decode"):
        assert handoff.engine_thread_cpus[role] == handoff.process_cpus[role], role



def test_the_step_traces_count_pulled_and_cached_kv_as_context_never_as_work(handoff: Handoff) -> None:
    """engine.step_trace_dir: each engine's steps with their batch shape, read from vLLM's own
    scheduler output (what calibrates the fleet simulator, baton/sim/served_steps.py)."""
    n, cached = len(handoff.prompt_ids), (len(handoff.prompt_ids) // BLOCK) * BLOCK
    for role, rows in handoff.step_traces.items():
        header, steps = rows[0]["engine"], rows[1:]
        assert (header["role"], header["block_size"], header["max_num_seqs"]) == (role, BLOCK, 4)
        assert steps and all(s["s"] > 0 for s in steps), role
        assert [s["t"] for s in steps] == sorted(s["t"] for s in steps), role
    prefill = handoff.step_traces["prefill"][1:]
    assert prefill[0]["p"] == [[n, 0]] and prefill[0]["d"] == []  # the whole prompt, one chunk
    decode = handoff.step_traces["decode"][1:]
    # D computes only the prompt's last token over the N-1 pulled positions, then decodes
    assert [s["d"] for s in decode[:REPLY_TOKENS]] == [[n - 1 + i] for i in range(REPLY_TOKENS)]
    assert all(s["p"] == [] for s in decode[:REPLY_TOKENS])
    # turn 2 prefills only what D's prefix cache lacks
    assert decode[REPLY_TOKENS]["p"] == [[len(handoff.turn2_ids) - cached, cached]]
