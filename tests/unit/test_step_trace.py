"""The engine step trace (baton/engine/step_trace.py) over a fake scheduler and engine; the real
vLLM path is checked in tests/e2e/test_nixl_handoff.py."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton.engine.step_trace import open_step_trace, step_shape


@dataclass
class NewReq:
    req_id: str
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str]
    num_computed_tokens: list[int]


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=lambda: Cached([], []))


class FakeScheduler:
    block_size = 128
    max_num_running_reqs = 8
    max_num_scheduled_tokens = 2048

    def __init__(self, outs: list[Out]):
        self.outs = outs

    def schedule(self) -> Out:
        return self.outs.pop(0)


class FakeEngine:
    def __init__(self, sched: FakeScheduler):
        self.sched = sched

    def step(self) -> list[str]:
        self.sched.schedule()
        return ["out"]


def test_shape_splits_prefill_chunks_from_decodes_with_their_context() -> None:
    out = Out({"a": 300, "b": 1, "c": 1}, [NewReq("a", 256)], Cached(["b", "c"], [40, 7]))
    assert step_shape(out) == ([[300, 256]], [40, 7])


def test_shape_of_something_that_is_not_a_scheduler_output_is_empty() -> None:
    assert step_shape(None) == ([], [])
    assert step_shape(Out({})) == ([], [])


def test_trace_writes_a_header_then_one_line_per_working_step(tmp_path: Path) -> None:
    sched = FakeScheduler([Out({"a": 100}, [NewReq("a", 0)]), Out({}), Out({"a": 1}, [], Cached(["a"], [100]))])
    trace = open_step_trace((str(tmp_path / "t"), "decode"), sched, 4096)
    assert trace is not None
    engine = FakeEngine(sched)
    assert [trace.step(engine) for _ in range(3)] == [["out"]] * 3
    trace.close()
    rows: list[dict[str, Any]] = [json.loads(x) for x in Path(trace.path).read_text().splitlines()]
    assert rows[0] == {"engine": {"role": "decode", "block_size": 128, "kv_capacity_tokens": 4096, "max_num_seqs": 8,
                                  "max_num_batched_tokens": 2048}}
    assert [(r["p"], r["d"]) for r in rows[1:]] == [([[100, 0]], []), ([], [100])]  # the idle step is not a line
    assert all(r["s"] >= 0 for r in rows[1:]) and rows[1]["g"] is None and rows[2]["g"] >= 0


def test_no_trace_when_off_or_when_the_folder_cannot_be_written(tmp_path: Path) -> None:
    assert open_step_trace(None, FakeScheduler([]), 0) is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert open_step_trace((str(blocker / "sub"), "decode"), FakeScheduler([]), 0) is None  # a file where the folder goes
