"""What an engine replica reports to the router (router/report.py ReplicaReport), how the replica
builds it from its engine's stats (deployments/replica_report.py), and how the directory stores
and shows it (router/directory_state.py)."""
from __future__ import annotations

import pytest

from baton.engine.types import EngineStats
from deployments.replica_report import HeldConversations, replica_report
from kv_transfer.ledger import TransferTotals
from router.directory_state import DirectorySettings, DirectoryState
from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport

STATS = EngineStats(kv_usage=0.25, kv_resident=0.5, kv_capacity_tokens=4096, num_running=2, num_waiting=3,
                    pending_prefill_tokens=700, in_flight=5, healthy=True, reason="", steps=99)
TRANSFERS = TransferTotals(requests_received=4, blocks_received=8, bytes_received=8192, failures=1, requests_offered=6)


def test_the_replica_builds_its_report_from_engine_stats_and_transfer_totals() -> None:
    report = replica_report("d0", "decode", STATS, TRANSFERS, {"checkpoints_held": 3, "segment_injections": 2})
    assert report == ReplicaReport(
        "d0", "decode", kv_usage=0.25, kv_resident=0.5, kv_capacity_tokens=4096, num_running=2, num_waiting=3,
        pending_prefill_tokens=700, in_flight=5, kv_transfers_received=4, kv_bytes_received=8192, kv_transfer_failures=1,
        kv_transfers_offered=6, extra=(("checkpoints_held", 3), ("segment_injections", 2)),
    )


def test_figures_are_the_flat_fields_then_the_extra_figures() -> None:
    figures = replica_report("p0", "prefill", STATS, TRANSFERS, {"checkpoints_held": 3}).figures()
    assert figures == {
        "kv_usage": 0.25, "kv_resident": 0.5, "kv_capacity_tokens": 4096, "num_running": 2, "num_waiting": 3,
        "pending_prefill_tokens": 700, "in_flight": 5, "kv_transfers_received": 4, "kv_bytes_received": 8192,
        "kv_transfer_failures": 1, "kv_transfers_offered": 6, "retained_tokens": 0, "offered_growth_tokens_per_s": 0.0,
        "served_growth_tokens_per_s": 0.0, "checkpoints_held": 3,
    }


def test_a_report_is_immutable_and_survives_pickling() -> None:
    import pickle

    report = replica_report("d0", "decode", STATS, TRANSFERS)
    with pytest.raises(AttributeError):
        report.kv_usage = 0.9  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(report)) == report  # crosses Ray to the directory


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pool": "unified"}, "unknown pool"),
        ({"kv_usage": -0.1}, "kv_usage"),
        ({"in_flight": -1}, "in_flight"),
        ({"kv_bytes_received": -5}, "kv_bytes_received"),
        ({"extra": (("a", 1.0), ("a", 2.0))}, "repeat"),
        ({"extra": (("kv_usage", 1.0),)}, "repeat"),
        ({"conversations": (("a", 1.0), ("a", 2.0))}, "distinct"),
        ({"conversations": (("", 1.0),)}, "non-empty"),
        ({"conversations": (("a", -1.0),)}, "idle"),
        ({"conversations": tuple((f"s{i}", 0.0) for i in range(MAX_REPORTED_CONVERSATIONS + 1))}, "at most"),
    ],
    ids=["pool", "kv_usage", "in_flight", "bytes", "duplicate-extra", "extra-shadows-field", "duplicate-conversation",
         "empty-session", "negative-idle", "too-many-conversations"],
)
def test_invalid_reports_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplicaReport(**{"replica_id": "d0", "pool": "decode", **kwargs})


def test_the_directory_stores_the_report_and_shows_its_figures() -> None:
    state = DirectoryState(DirectorySettings(policy="colocated", stale_after_s=10.0))
    report = replica_report("d0", "decode", STATS, TRANSFERS, {"checkpoints_held": 3, "live": 0}, node_id="n1")
    state.report(report, 1.0)
    assert state.live("decode", 2.0) == [report]
    shown = state.snapshot(2.0)["replicas"]["d0"]
    assert shown == {**report.figures(), "pool": "decode", "node_id": "n1", "live": True, "pinned": 0, "age_s": 1.0,  # directory keys win
                     "cliff_eta_s": None}  # no real-time session grows there
    assert "node_id" not in report.figures()  # where a replica runs is shown, never a load figure
    plan = state.route("s", None, 100, 2.0)
    assert plan.decode_replica == "d0"
    state.check_integrity()


def test_a_decoder_reports_the_conversations_it_served_lately_most_recent_first() -> None:
    held = HeldConversations(capacity=3)
    for sid, at in (("a", 1.0), ("b", 2.0), (None, 2.5), ("c", 3.0), ("a", 4.0), ("d", 5.0)):
        held.served(sid, at)  # None: a request outside any conversation
    assert len(held) == 3  # b fell out: the least recently served
    report = replica_report("d0", "decode", STATS, TRANSFERS, conversations=held.recent(6.0))
    assert report.conversations == (("d", 1.0), ("a", 2.0), ("c", 3.0))
    assert "conversations" not in report.figures()  # not a figure: Serve's routing stats stay numbers
    with pytest.raises(ValueError):
        HeldConversations(capacity=MAX_REPORTED_CONVERSATIONS + 1)
