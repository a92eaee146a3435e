"""Conversation traces for Baton: the JSONL format, builders (BFCL, LoCoMo) and the replayer.

- traces.format   Conversation / Turn models, load_trace, dump_trace
- traces.bfcl     BFCL v4 multi-turn -> agentic conversations (tool results executed)
- traces.locomo   LoCoMo -> long multi-session chats
- traces.replay   replay(conversations, url, concurrency, ...) -> ReplayResult
- traces.report   summarize, format_table, write_json, plot
See docs/TRACES.md.
"""

from baton.traces.format import Conversation, TraceError, Turn, dump_trace, load_trace

__all__ = ["Conversation", "TraceError", "Turn", "dump_trace", "load_trace"]
