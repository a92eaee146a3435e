"""Pool CPU cores (`<pool>.resources.cpu_cores`): config validation, the slices and the spec
plumbing (baton/engine/args.py, baton/engine/cpu_cores.py), slice claims between replicas, and
the engine thread's affinity around a build. No engine is started."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from baton.engine.args import EngineSpec, build_engine_spec
from baton.engine.config import EngineConfig
from baton.engine.cpu_cores import CpuCores, claim_cores, core_slices, is_poller, poller_cores
from baton.engine.vllm_engine import engine_thread_affinity
from deployments.config import ConfigError, load_app_config


def spec_of(cfg: EngineConfig, cores: tuple[int, ...] | None, per_replica: int | None = None, on_gpu: bool = False) -> EngineSpec:
    return build_engine_spec(cfg, role="decode", handoff=False, model_path="/m", on_gpu=on_gpu, cache_root="/c",
                             cpu_cores=cores, cores_per_replica=per_replica)


def app_args(resources: dict) -> dict:
    return {"routing": {"policy": "colocated"}, "decode": {"engine": {"model": "m"}, "resources": resources}}


# ---- config ---------------------------------------------------------------------------------------


def test_cpu_cores_are_read_from_the_pool_resources() -> None:
    cfg = load_app_config(app_args({"cpu_cores": [1, 0], "cpu_cores_per_replica": 1}))
    assert cfg.decode.resources.cpu_cores == (1, 0) and cfg.decode.resources.cpu_cores_per_replica == 1
    assert load_app_config(app_args({})).decode.resources.cpu_cores is None


@pytest.mark.parametrize("resources", [
    {"cpu_cores": [0, 0]},  # duplicate
    {"cpu_cores": [-1]},  # negative
    {"cpu_cores": []},  # empty
    {"cpu_cores": ["x"]},  # not an int
    {"cpu_cores": [0.5]},  # not an int
    {"cpu_cores_per_replica": 1},  # no cores to cut
    {"cpu_cores": [0], "cpu_cores_per_replica": 2},  # more per replica than there are
])
def test_bad_cpu_cores_fail_by_field(resources: dict) -> None:
    with pytest.raises(ConfigError, match="decode.resources"):
        load_app_config(app_args(resources))


# ---- slices ----------------------------------------------------------------------------------------


def test_core_slices() -> None:
    assert core_slices((0, 1), None) == ((0, 1),)
    assert core_slices((0, 1), 1) == ((0,), (1,))
    assert core_slices((4, 5, 6, 7, 8), 2) == ((4, 5), (6, 7))  # the short remainder is dropped
    with pytest.raises(ValueError):
        core_slices((0, 1), 3)
    with pytest.raises(ValueError):
        core_slices((), None)


# ---- spec plumbing ---------------------------------------------------------------------------------


def test_one_slice_pins_the_spec_and_sets_one_thread_per_core() -> None:
    spec = spec_of(EngineConfig(model="m"), (2, 3))
    assert spec.cores == (2, 3) and spec.cpu == CpuCores(((2, 3),), None)
    assert spec.env["OMP_NUM_THREADS"] == "2"


def test_an_explicit_cpu_threads_wins_over_the_core_count() -> None:
    spec = spec_of(EngineConfig(model="m", cpu_threads=1), (2, 3))
    assert spec.cores == (2, 3) and spec.env["OMP_NUM_THREADS"] == "1"


def test_several_slices_leave_the_choice_to_the_replica() -> None:
    spec = spec_of(EngineConfig(model="m"), (0, 1), per_replica=1)
    assert spec.cores == () and spec.cpu is not None and spec.cpu.slices == ((0,), (1,))
    assert spec.env["OMP_NUM_THREADS"] == "1"  # EngineConfig's default until a slice is taken
    pinned = spec.pinned_to((1,))
    assert pinned.cores == (1,) and pinned.env["OMP_NUM_THREADS"] == "1"


def test_no_cores_and_gpus_leave_the_spec_unpinned() -> None:
    for spec in (spec_of(EngineConfig(model="m"), None), spec_of(EngineConfig(model="m"), (0,), on_gpu=True)):
        assert spec.cpu is None and spec.cores == ()
        with pytest.raises(ValueError):
            spec.pinned_to((0,))


def test_build_app_hands_the_pool_cores_to_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from deployments import app

    seen = {}

    def recording(cfg: EngineConfig, **kw: Any) -> EngineSpec:
        seen[kw["role"]] = (kw["cpu_cores"], kw["cores_per_replica"])
        return build_engine_spec(cfg, **{**kw, "handoff": False})

    monkeypatch.setattr(app, "build_engine_spec", recording)
    monkeypatch.setattr(app, "resolve_model_path", lambda model, cache: "/m")
    args = {"routing": {"policy": "conversation", "ownership_db_path": ":memory:"},
            "prefill": {"engine": {"model": "m"}, "resources": {"cpu_cores": [0]}},
            "decode": {"engine": {"model": "m"}, "resources": {"cpu_cores": [1]}}}
    app.build_app(args)
    assert seen == {"prefill": ((0,), None), "decode": ((1,), None)}


# ---- claims ----------------------------------------------------------------------------------------


def test_replicas_claim_distinct_slices_then_share_all(tmp_path: Path) -> None:
    cpu = CpuCores(((0,), (1,)))
    a, b = claim_cores("decode", cpu, tmp_path), claim_cores("decode", cpu, tmp_path)
    assert (a.cores, b.cores) == ((0,), (1,))
    c = claim_cores("decode", cpu, tmp_path)
    assert c.cores == (0, 1) and c.handle is None  # none free: all the pool's cores
    assert claim_cores("prefill", cpu, tmp_path).cores == (0,)  # another pool's slices are its own
    a.release()
    assert claim_cores("decode", cpu, tmp_path).cores == (0,)  # a released slice is free again
    b.release()


def test_a_single_slice_is_never_locked(tmp_path: Path) -> None:
    claim = claim_cores("decode", CpuCores(((0, 1),)), tmp_path)
    assert claim.cores == (0, 1) and claim.handle is None and not list(tmp_path.iterdir())


# ---- affinity around a build ---------------------------------------------------------------------------


def test_the_build_thread_and_the_threads_it_starts_run_on_the_pool_cores() -> None:
    core = min(os.sched_getaffinity(0))
    spec = spec_of(EngineConfig(model="m"), (core,))
    seen: dict[str, set[int]] = {}
    release = threading.Event()

    def build() -> None:
        with engine_thread_affinity(spec):
            seen["during"] = os.sched_getaffinity(0)
            worker = threading.Thread(target=release.wait)
            worker.start()
            os.sched_setaffinity(0, {max(os.sched_getaffinity(os.getpid()))})  # what NIXL does to its caller
        seen["after"] = os.sched_getaffinity(0)
        seen["worker"] = os.sched_getaffinity(worker.native_id)
        release.set()
        worker.join()

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert seen == {"during": {core}, "after": {core}, "worker": {core}}


def test_pollers_go_to_the_cores_the_engine_does_not_use() -> None:
    assert poller_cores((0, 1, 2, 3), (1,)) == (0, 2, 3)
    assert poller_cores((0, 1), (0, 1)) == (0, 1)  # the engine has every core: nowhere else to go
    assert poller_cores((1,), (1,)) == (1,)
    assert is_poller("gloo_tcp_loop") and not is_poller("ray::IDLE") and not is_poller("")


def _named(name: str) -> None:
    """Set the calling thread's kernel name (what /proc/self/task/<tid>/comm shows)."""
    import ctypes

    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell them apart")
def test_a_polling_thread_the_build_starts_leaves_the_engine_cores() -> None:
    mask = os.sched_getaffinity(0)
    core = min(mask)
    spec = spec_of(EngineConfig(model="m"), (core,))
    seen: dict[str, set[int]] = {}
    release, named = threading.Event(), threading.Event()

    def poll() -> None:
        _named("gloo_tcp_loop")
        named.set()
        release.wait()

    def build() -> None:
        with engine_thread_affinity(spec):
            poller, worker = threading.Thread(target=poll), threading.Thread(target=release.wait)
            poller.start()
            worker.start()
            named.wait(5)
        seen["engine"] = os.sched_getaffinity(0)
        seen["worker"] = os.sched_getaffinity(worker.native_id)
        seen["poller"] = os.sched_getaffinity(poller.native_id)
        release.set()
        poller.join()
        worker.join()

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert seen == {"engine": {core}, "worker": {core}, "poller": mask - {core}}


def test_without_cores_the_build_thread_gets_its_affinity_back() -> None:
    spec = spec_of(EngineConfig(model="m"), None)
    mask = os.sched_getaffinity(0)
    seen = {}

    def build() -> None:
        with engine_thread_affinity(spec):
            os.sched_setaffinity(0, {min(mask)})
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert seen["after"] == mask


def test_a_replica_pins_its_spec_to_the_slice_it_claimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from baton.engine import cpu_cores

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from deployments.pool import cores_for_this_replica

    monkeypatch.setattr(cpu_cores, "default_lock_dir", lambda: tmp_path)
    spec = spec_of(EngineConfig(model="m"), (0, 1), per_replica=1)
    (first, a), (second, b) = cores_for_this_replica("decode", spec), cores_for_this_replica("decode", spec)
    assert (first.cores, second.cores) == ((0,), (1,)) and first.env["OMP_NUM_THREADS"] == "1"
    assert a is not None and b is not None
    pinned = spec_of(EngineConfig(model="m"), (1,))
    assert cores_for_this_replica("decode", pinned) == (pinned, None)  # one slice: already pinned, nothing claimed
    a.release()
    b.release()
