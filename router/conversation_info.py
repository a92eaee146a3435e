"""What GET /v1/conversations/{id} tells a conversation's owner (DirectoryState.describe)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConversationInfo:
    """What GET /v1/conversations/{id} tells the owner (DirectoryState.describe)."""

    session_id: str
    decoder: str
    turns: int  # turns placed (a rebuilt pin counts the turns this directory has seen)
    handoffs: int  # KV handoffs from the prefill pool
    context_tokens: int  # the last turn's prompt tokens (0: not known since a directory restart)
    resident: bool  # the decoder's latest report lists it: its KV is held there (in use or cached)
    idle_s: float
    age_s: float
    adopted: bool  # the pin was rebuilt from the decoder's report after a directory restart

    def as_json(self) -> dict[str, Any]:
        return {"id": self.session_id, "object": "conversation", "decoder": self.decoder, "turns": self.turns,
                "handoffs": self.handoffs, "context_tokens": self.context_tokens, "resident": self.resident,
                "idle_s": round(self.idle_s, 3), "age_s": round(self.age_s, 3), "adopted": self.adopted}
