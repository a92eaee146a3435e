"""The application this folder's modules share: the colocated policy (no prefill pool), 2 decode
engines in float32, 1 ingress replica (so /baton/stats and the real-time admission cap answer from
the ingress that served the request), real-time sessions bounded to 16 sink + 64 window tokens with
an AIMD cap of 2, and the conversation directory in 2 shards relaying the engines' reports (so
every module here runs through the sharded directory; the other apps keep one). test_realtime_app: real-time sessions over the
WebSocket; test_stream_resume: a stream that survives its decoder (the kill runs last);
test_directory_shards_app: conversations routed, pinned, refused and ended across the shards."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SharedApp, e2e_args, run_shared_app

REALTIME_CAP = 2
DIRECTORY_SHARDS = 2
RELAY_PERIOD_S = 0.5  # each engine reports to its home shard, which relays (router/report_relay.py)


@pytest.fixture(scope="package")
def shared_app() -> Iterator[SharedApp]:
    args = e2e_args(policy="colocated", decode_replicas=2, prefill_replicas=0, ingress_replicas=1)
    # float32 (the default is bfloat16 where the CPU has it): test_stream_resume's continuation
    # prefills tokens the undisturbed run decoded one by one; float32 makes their rounding
    # differences too small to flip an argmax but at a near tie
    args["decode"]["engine"] = {**args["decode"]["engine"], "dtype": "float32"}
    args["routing"] = {**args["routing"], "directory_shards": DIRECTORY_SHARDS, "report_relay_period_s": RELAY_PERIOD_S}
    args["realtime"] = {"mode": "bounded", "sink_tokens": 16, "window_tokens": 64, "max_tokens_per_tick": 8,
                        "admission": {"initial_cap": REALTIME_CAP, "min_cap": 1}}
    yield from run_shared_app(args)
