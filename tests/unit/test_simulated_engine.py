"""The simulated engine behind the runner (baton/engine/simulated/engine.py), in process, no vLLM engine.

EngineRunner builds it from a pool's EngineConfig through the same factory choice the replicas make
(engine_factory_for), streams deltas with finish reasons and prefix hits, publishes scheduler stats,
and aborts. The P/D handoff runs on two engines with a fake clock: the prefill side returns
NIXL-shaped params and holds its blocks for the transfer, the decode side waits the transfer time
the link bandwidth gives, and both write the transfer ledger.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from baton.engine.args import EngineSpec, build_engine_spec
from baton.engine.config import EngineConfig
from baton.engine.runner import EngineRunner
from baton.engine.simulated.blocks import BlockPool
from baton.engine.simulated.engine import SimulatedEngine, build_simulated_engine
from baton.engine.simulated.handoff import HandoffAccounting, HandoffLink
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.outputs import PLACEHOLDER_TEXT
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits
from baton.engine.simulated.timing import StepBatch, StepTime
from baton.engine.types import GenerationDelta, GenerationRequest, SamplingSpec
from baton.engine.vllm_engine import build_vllm_engine, engine_factory_for
from baton.paths import REPO_ROOT
from kv_transfer.ledger import TransferLedger

WAIT_S = 20.0
SIM = {"gpu": "h200_sxm", "model": "meta-llama/Meta-Llama-3.1-8B", "kv_capacity_tokens": 4096, "time_scale": 0.01}


def spec_for(role: str = "decode", handoff: bool = False, **engine: Any) -> EngineSpec:
    cfg = EngineConfig(model="m", kind="simulated", simulated=SIM, **engine)
    # the repo's cache: the step table is built once, by the first test (or replica) that needs it
    return build_engine_spec(cfg, role=role, handoff=handoff, model_path="/m", on_gpu=False, cache_root=str(REPO_ROOT / ".cache"))  # type: ignore[arg-type]


def request(rid: str, prompt: tuple[int, ...], max_tokens: int, **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=max_tokens), **kw)


async def collect(runner: EngineRunner, req: GenerationRequest) -> list[GenerationDelta]:
    async def run() -> list[GenerationDelta]:
        return [d async for d in runner.generate(req)]

    return await asyncio.wait_for(run(), WAIT_S)


@pytest.fixture(scope="module")
def runner() -> Any:
    spec = spec_for(max_num_batched_tokens=256)
    r = EngineRunner(spec, engine_factory=engine_factory_for(spec))
    yield r
    r.shutdown()


def test_the_factory_follows_the_engine_kind() -> None:
    assert engine_factory_for(spec_for()) is build_simulated_engine
    vllm = build_engine_spec(EngineConfig(model="m"), role="decode", handoff=False, model_path="/m", on_gpu=False, cache_root="/c")
    assert engine_factory_for(vllm) is build_vllm_engine and vllm.simulated is None


def test_the_runner_streams_placeholder_tokens_to_a_length_finish(runner: EngineRunner) -> None:
    prompt = tuple(range(100, 400))
    deltas = asyncio.run(collect(runner, request("a", prompt, 6)))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 6
    assert "".join(d.text for d in deltas) == PLACEHOLDER_TEXT * 6
    assert deltas[0].prompt_tokens == 300 and deltas[0].timing is not None
    again = asyncio.run(collect(runner, request("b", prompt, 2)))
    assert again[-1].cached_tokens == 288  # the whole prompt but its last partial block, from a's cached blocks


def test_the_runner_publishes_the_simulated_pool(runner: EngineRunner) -> None:
    # stats are published after each step's outputs are handed out: an earlier test's last
    # output can reach it a moment before the stats of that step do
    for _ in range(200):
        if runner.stats.num_running == 0:
            break
        time.sleep(0.01)
    stats = runner.stats
    assert stats.healthy and stats.kv_capacity_tokens == 4096  # 256 blocks of 16
    assert stats.num_running == 0 and stats.kv_usage == 0.0 and stats.kv_resident > 0  # cached blocks stay resident


def test_a_cancelled_request_is_aborted_and_its_blocks_freed(runner: EngineRunner) -> None:
    async def cancel_after_two() -> None:
        gen = runner.generate(request("long", tuple(range(500, 700)), 10_000))
        n = 0
        async for _ in gen:
            n += 1
            if n == 2:
                break
        await gen.aclose()

    asyncio.run(asyncio.wait_for(cancel_after_two(), WAIT_S))
    for _ in range(200):
        if runner.stats.in_flight == 0 and runner.stats.kv_usage == 0.0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert runner.stats.in_flight == 0 and runner.stats.kv_usage == 0.0


def test_a_prompt_past_max_model_len_fails_that_request_only(runner: EngineRunner) -> None:
    from baton.engine.types import EngineRequestError

    with pytest.raises(EngineRequestError, match="max_model_len"):
        asyncio.run(collect(runner, request("huge", tuple(range(5000)), 1)))
    assert runner.stats.healthy


# ---- P/D handoff on a fake clock -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FixedTimer:
    def step_time(self, batch: StepBatch) -> StepTime:
        return StepTime(0.0 if batch.empty else 0.001, "decode")


BLOCK_BYTES = 16 * 131072  # Llama-3.1-8B: 128 KiB of bf16 KV a token


def engine_on(clock: Clock, ledger: TransferLedger, link_gbps: float = 8.0) -> SimulatedEngine:
    handoff = HandoffAccounting(HandoffLink(link_gbps, BLOCK_BYTES), ledger)
    sched = Scheduler(SchedulerLimits(8, 512, 2048), KVCacheManager(BlockPool(64, 16), 2048), handoff, clock=clock.now)
    return SimulatedEngine(sched, FixedTimer(), sleep=clock.sleep)


class Params:
    def __init__(self, max_tokens: int, kv: dict[str, Any] | None = None):
        self.max_tokens, self.logprobs = max_tokens, None
        self.extra_args = {"kv_transfer_params": kv} if kv else None


def run_until_done(engine: SimulatedEngine, rid: str) -> list[Any]:
    outs: list[Any] = []
    for _ in range(10_000):
        outs += [o for o in engine.step() if o.request_id == rid]
        if outs and outs[-1].finished:
            return outs
    raise AssertionError(f"{rid} did not finish")


def test_a_handoff_moves_the_prompt_blocks_and_charges_the_link() -> None:
    clock, ledger = Clock(), TransferLedger()
    prefill, decode = engine_on(clock, ledger), engine_on(clock, ledger)
    prompt = list(range(1000, 1100))  # 100 tokens: 7 blocks
    prefill.add_request("p", {"prompt_token_ids": prompt}, Params(1, {"do_remote_decode": True}))
    done = run_until_done(prefill, "p")[-1]
    params = done.kv_transfer_params
    assert params["do_remote_prefill"] and len(params["remote_block_ids"][0]) == 7 and params["remote_num_tokens"] == 100
    assert prefill.scheduler.has_requests() and not prefill.has_unfinished_requests()  # blocks held for the reader
    assert ledger.totals().blocks_offered == 7

    started = clock.now()
    decode.add_request("d", {"prompt_token_ids": prompt}, Params(3, params))
    outs = run_until_done(decode, "d")
    transfer_s = 7 * BLOCK_BYTES * 8 / 8e9  # 7 blocks over 8 Gbit/s
    assert clock.now() - started >= transfer_s
    assert outs[0].num_cached_tokens == 100 and sum(len(o.outputs[0].token_ids) for o in outs) == 3
    totals = ledger.totals()
    assert totals.requests_received == 1 and totals.blocks_received == 7 and totals.bytes_received == 7 * BLOCK_BYTES

    while prefill.scheduler.has_requests():  # the runner keeps stepping a holding engine: it frees after the transfer
        prefill.step()
    assert ledger.totals().requests_sent == 1
    for engine in (prefill, decode):
        engine.scheduler.check_integrity()
        assert engine.scheduler.kv_cache_manager.usage == 0.0
    ledger.check_integrity()


def test_a_decoder_with_the_prefix_cached_pulls_only_the_rest() -> None:
    clock, ledger = Clock(), TransferLedger()
    decode = engine_on(clock, ledger)
    system = list(range(2000, 2064))  # 4 blocks the decoder already holds
    decode.add_request("warm", {"prompt_token_ids": system + [1]}, Params(1))
    run_until_done(decode, "warm")
    params = {"do_remote_prefill": True, "remote_block_ids": [list(range(8))], "remote_engine_id": "p0"}
    decode.add_request("d", {"prompt_token_ids": system + list(range(64))}, Params(1, params))  # 128 tokens: 8 blocks
    run_until_done(decode, "d")
    assert ledger.totals().blocks_received == 4


def test_aborting_a_decoder_waiting_for_its_kv_records_a_failed_receive() -> None:
    clock, ledger = Clock(), TransferLedger()
    decode = engine_on(clock, ledger, link_gbps=0.001)  # a transfer that takes hours
    decode.add_request("d", {"prompt_token_ids": list(range(40))}, Params(2, {"do_remote_prefill": True}))
    decode.step()
    decode.abort_request(["d"])
    assert ledger.totals().failures == 1 and not decode.scheduler.has_requests()
    decode.scheduler.check_integrity()


def test_a_request_through_a_stand_in_engine_never_imports_vllm() -> None:
    """A stand-in replica must not pay vLLM's import (seconds of CPU, ~0.5 GiB) on its first request."""
    import subprocess
    import sys

    code = (
        "import asyncio, sys\n"
        "from tests.unit.test_simulated_engine import spec_for, request, collect\n"
        "from baton.engine.runner import EngineRunner\n"
        "from baton.engine.simulated.engine import build_simulated_engine\n"
        "r = EngineRunner(spec_for(), engine_factory=build_simulated_engine)\n"
        "d = asyncio.run(collect(r, request('x', tuple(range(100, 200)), 3)))\n"
        "r.shutdown()\n"
        "assert d[-1].finished, d\n"
        "print('VLLM' if 'vllm' in sys.modules else 'NO_VLLM')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "NO_VLLM"
