"""`baton trace ...` and `baton replay` wiring (the replay itself is tested with a fake server)."""

import pytest

from baton.cli import build_parser, main
from baton.traces.format import load_trace


def test_parser_has_commands():
    parser = build_parser()
    args = parser.parse_args(["replay", "t.jsonl", "--url", "http://x", "--concurrency", "3", "--limit", "2"])
    assert (args.concurrency, args.limit, args.model) == (3, 2, None)
    assert callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "bfcl"])  # --out is required


def test_trace_check(tmp_path, capsys):
    good = tmp_path / "t.jsonl"
    good.write_text('{"conversation_id": "a", "turns": [{"role": "user", "content": "hi"}]}\n')
    assert main(["trace", "check", str(good)]) == 0
    assert "1 conversations, 1 turns" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversation_id": "a", "turns": [{"role": "bot", "content": "hi"}]}\n')
    assert main(["trace", "check", str(bad)]) == 2
    assert "bad.jsonl:1: field 'turns.0.role'" in capsys.readouterr().err


def test_replay_bad_trace_exits_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--url", "http://x"]) == 2


def test_trace_bfcl(tmp_path):
    pytest.importorskip("bfcl_eval", reason="bfcl_eval is not installed")
    out = tmp_path / "b.jsonl"
    assert main(["trace", "bfcl", "--out", str(out), "--n", "1", "--max-user-turns", "1",
                 "--max-tokens", "16"]) == 0
    (conv,) = load_trace(out)
    assert len(conv.turns) == 2 and conv.turns[0].max_tokens == 16


def test_trace_locomo_missing_dir(tmp_path, capsys):
    assert main(["trace", "locomo", "--out", str(tmp_path / "l.jsonl"), "--data-dir", str(tmp_path / "no")]) == 2
    assert "not found" in capsys.readouterr().err
