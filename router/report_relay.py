"""Reports relayed between directory shards (`routing.report_relay_period_s`), so an engine replica
makes one call per report period instead of one per shard. Pure state; the directory
(router/directory.py) runs the loop and the calls, deployments/directory_client.py the replica's side.

Why: every shard places new conversations from every replica's load, so with K shards and R
replicas each replica sent R·K report calls per period, and each call costs a shard Serve's
per-call CPU whatever it carries — the fixed cost a second shard added in `baton bench control`.
With the relay a replica reports to its home shard (its replica id hashed, router/directory_shards.py),
and each shard sends every other shard the reports it received since its last flush in one call:
R + K·(K − 1) calls per relay period.

What is relayed: the periodic reports (deltas, router/held_mirror.py). A complete list of
conversations is the answer to one shard's ask and goes to that shard only. A shard that wants a
replica's complete list after a relayed delta says so in the relay call's reply; the home shard
passes the ask on in its reply to the replica's next report (`RelayAsks`), and the replica sends
the list to the asking shard directly. A replica whose home shard does not answer reports to every
shard directly until it does (deployments/directory_client.py).

Invariants (check_integrity): the outbox holds each report once, in arrival order; asks name only
shards of this directory other than the one keeping them.
"""
from __future__ import annotations

from router.report import ReplicaReport


class ReportOutbox:
    """The reports this shard received as a home shard, waiting for the next flush."""

    def __init__(self) -> None:
        self._reports: list[ReplicaReport] = []

    def add(self, report: ReplicaReport) -> None:
        self._reports.append(report)

    def take(self) -> list[ReplicaReport]:
        out, self._reports = self._reports, []
        return out

    def __len__(self) -> int:
        return len(self._reports)


class RelayAsks:
    """Replica id -> the other shards that asked for its complete list through this (home) shard."""

    def __init__(self, shard: int, shards: int):
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} out of range for {shards} shards")
        self.shard, self.shards = shard, shards
        self._asks: dict[str, set[int]] = {}

    def add(self, asking_shard: int, replica_ids: list[str]) -> None:
        if not 0 <= asking_shard < self.shards or asking_shard == self.shard:
            raise ValueError(f"shard {asking_shard} cannot ask through shard {self.shard} of {self.shards}")
        for rid in replica_ids:
            self._asks.setdefault(rid, set()).add(asking_shard)

    def take(self, replica_id: str) -> tuple[int, ...]:
        """The shards waiting for `replica_id`'s complete list (sorted), forgotten once told."""
        return tuple(sorted(self._asks.pop(replica_id, ())))

    def check_integrity(self) -> None:
        for rid, shards in self._asks.items():
            if not shards or self.shard in shards or not all(0 <= s < self.shards for s in shards):
                raise AssertionError(f"bad relay asks for {rid}: {sorted(shards)}")
