"""`baton replay` and `baton trace {bfcl,locomo,check}` (registered by baton/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    _register_replay(subparsers)
    _register_trace(subparsers)


# --- baton replay -------------------------------------------------------------------------

def _register_replay(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay", help="replay a JSONL trace against an OpenAI-compatible server")
    p.add_argument("trace", type=Path, help="JSONL trace (see docs/TRACES.md)")
    p.add_argument("--url", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (gRPC: host:port, e.g. 127.0.0.1:9000)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http",
                   help="http (SSE, default) or grpc (Baton's ChatCompletionStream RPC)")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight (default 4)")
    p.add_argument("--out", type=Path, default=None,
                   help="output dir (default runs/replay-<timestamp>)")
    p.add_argument("--model", default=None,
                   help="model id (default: first of GET /v1/models; gRPC: the server's own)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer <key>' (header or gRPC metadata)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N conversations")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request limit (default 300)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--max-tool-rounds", type=int, default=3,
                   help="native traces: requests answering tool results per user turn (default 3)")
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    from baton.traces.format import TraceError, load_trace
    from baton.traces.replay import ReplayError, replay
    from baton.traces.report import format_table, plot, summarize, write_json

    try:
        convs = load_trace(args.trace)[: args.limit]
    except (OSError, TraceError) as e:
        print(f"baton replay: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / f"replay-{dt.datetime.now():%Y%m%d-%H%M%S}"
    try:
        result = asyncio.run(replay(convs, args.url, args.concurrency, model=args.model,
                                    api_key=args.api_key, timeout_s=args.timeout_s,
                                    progress=not args.no_progress, protocol=args.protocol,
                                    max_tool_rounds=args.max_tool_rounds))
    except (ReplayError, ValueError) as e:
        print(f"baton replay: {e}", file=sys.stderr)
        return 2
    summary = summarize(result)
    print(format_table(summary))
    json_path = write_json(result, out / "replay.json")
    png_path = plot(result, out / "replay.png")
    print(f"\nwrote {json_path} and {png_path}")
    for conv in result.conversations:
        if conv.error:
            print(f"error in {conv.conversation_id} (turn {conv.turns_sent - 1}): {conv.error}",
                  file=sys.stderr)
    return 1 if summary.errors else 0


# --- baton trace ---------------------------------------------------------------------------

def _register_trace(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="build or check JSONL traces")
    sub = p.add_subparsers(dest="trace_command", metavar="SOURCE", required=True)

    b = sub.add_parser("bfcl", help="BFCL v4 multi-turn -> agentic conversations")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--category", action="append", dest="categories", default=None,
                   choices=["base", "long_context", "miss_func", "miss_param"],
                   help="repeatable (default: base)")
    b.add_argument("--n", type=int, default=6, help="conversations (default 6)")
    b.add_argument("--ids", nargs="+", default=(), help="exactly these BFCL entry ids")
    b.add_argument("--min-user-turns", type=int, default=1)
    b.add_argument("--max-user-turns", type=int, default=None)
    b.add_argument("--max-system-chars", type=int, default=None)
    b.add_argument("--drop-response-schema", action="store_true",
                   help="leave the 'response' schemas out of the tool docs")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--mode", choices=["prompting", "native"], default="prompting",
                   help="prompting: tool docs in the system prompt, tool turns precomputed "
                   "(default); native: OpenAI tools, user turns only, calls run live by replay")
    b.set_defaults(func=run_trace_bfcl)

    lo = sub.add_parser("locomo", help="LoCoMo -> long multi-session chats")
    lo.add_argument("--out", type=Path, required=True)
    lo.add_argument("--data-dir", type=Path, default=None,
                    help="folder of conv-*.json (default ../shared/data/locomo from the repo)")
    lo.add_argument("--samples", nargs="+", default=(), help="e.g. conv-26 conv-30")
    lo.add_argument("--mode", choices=["line", "session"], default="line")
    lo.add_argument("--max-sessions", type=int, default=None)
    lo.add_argument("--max-turns", type=int, default=None)
    lo.add_argument("--qa-questions", type=int, default=0)
    lo.add_argument("--max-tokens", type=int, default=64)
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--session-gap-s", type=float, default=10.0)
    lo.set_defaults(func=run_trace_locomo)

    c = sub.add_parser("check", help="validate a trace and print its size")
    c.add_argument("trace", type=Path)
    c.set_defaults(func=run_trace_check)


def _wrote(path: Path, convs: list) -> int:
    turns = sum(len(c.turns) for c in convs)
    print(f"wrote {path}: {len(convs)} conversations, {turns} turns")
    return 0


def run_trace_bfcl(args: argparse.Namespace) -> int:
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace
    from baton.traces.format import dump_trace

    opts = BfclOptions(
        categories=tuple(args.categories or ("base",)), n=args.n, ids=tuple(args.ids),
        min_user_turns=args.min_user_turns, max_user_turns=args.max_user_turns,
        max_system_chars=args.max_system_chars, drop_response_schema=args.drop_response_schema,
        max_tokens=args.max_tokens, seed=args.seed, mode=args.mode)
    convs = build_bfcl_trace(opts)
    return _wrote(dump_trace(convs, args.out), convs)


def run_trace_locomo(args: argparse.Namespace) -> int:
    from baton.traces.format import dump_trace
    from baton.traces.locomo import LocomoOptions, build_locomo_trace, default_locomo_dir

    opts = LocomoOptions(
        data_dir=args.data_dir or default_locomo_dir(), samples=tuple(args.samples),
        mode=args.mode, max_sessions=args.max_sessions, max_turns=args.max_turns,
        qa_questions=args.qa_questions, max_tokens=args.max_tokens, seed=args.seed,
        session_gap_s=args.session_gap_s)
    try:
        convs = build_locomo_trace(opts)
    except FileNotFoundError as e:
        print(f"baton trace locomo: {e}", file=sys.stderr)
        return 2
    return _wrote(dump_trace(convs, args.out), convs)


def run_trace_check(args: argparse.Namespace) -> int:
    from baton.traces.format import TraceError, load_trace

    try:
        convs = load_trace(args.trace)
    except (OSError, TraceError) as e:
        print(f"baton trace check: {e}", file=sys.stderr)
        return 2
    turns = [t for c in convs for t in c.turns]
    chars = sum(len(c.system or "") for c in convs) + sum(len(t.content) for t in turns)
    tools = sum(len(json.dumps(c.tools)) for c in convs if c.tools)
    native = sum(c.native for c in convs)
    print(f"{args.trace}: {len(convs)} conversations, {len(turns)} turns "
          f"({sum(t.effective for t in turns)} effective), ~{chars // 4} prompt tokens of text "
          f"(system + turns, 4 chars/token), {sum(t.think_time_s for t in turns):.1f} s think time"
          + (f"; {native} native (tool calls run live), ~{tools // 4} tokens of tools JSON"
             if native else ""))
    return 0
