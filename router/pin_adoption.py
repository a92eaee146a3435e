"""Pins back from a decoder's report (ReplicaReport.conversations: the conversations whose KV it
holds, with their idle time), so a restarted directory sends returning conversations back to
their decoder. Pure over the directory's pin table and its owner lookup.

Rules: a pin this directory placed is never overridden; of two decoders claiming one
conversation the one that served it last wins; conversations idle past the TTL, ended, never
owned or another shard's (router/directory_shards.py) are not adopted; a full directory adopts
nothing (adoption is best effort)."""
from __future__ import annotations

from collections.abc import Callable

from router.directory_shards import shard_of
from router.directory_types import DirectorySettings, Pin
from router.pin_table import PinTable
from router.report import ReplicaReport


def adopt_pins(pins: PinTable, report: ReplicaReport, now: float, s: DirectorySettings,
               owner_of: Callable[[str], str | None]) -> list[str]:
    """Adopt what the rules allow from `report` into `pins`; the session ids adopted, in report order."""
    adopted = []
    for sid, idle in report.conversations:
        if not _eligible(pins, sid, idle, now, s) or (pins.get(sid) is None and len(pins) >= s.max_conversations):
            continue
        owner = owner_of(sid)
        if owner is None:
            continue
        pins.put(sid, Pin(report.replica_id, owner or None, now - idle, now - idle, adopted=True))
        adopted.append(sid)
    return adopted


def adoption_candidates(pins: PinTable, report: ReplicaReport, now: float, s: DirectorySettings) -> list[str]:
    """The session ids whose owner adopt_pins would ask for (so the caller can read them in bulk first)."""
    return [sid for sid, idle in report.conversations if _eligible(pins, sid, idle, now, s)]


def _eligible(pins: PinTable, sid: str, idle: float, now: float, s: DirectorySettings) -> bool:
    pin = pins.get(sid)
    if idle > s.conversation_ttl_s or (pin is not None and (not pin.adopted or pin.last_seen >= now - idle)):
        return False
    return shard_of(sid, s.shards) == s.shard
