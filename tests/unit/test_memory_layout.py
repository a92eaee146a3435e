"""Where recalled facts go in a chat prompt (memory_store/layout.py) and the invariant of the
injection it produces (kv_transfer/injection.py MemoryInjection.check_integrity). FakeTokenizer: one
token per whitespace-separated word, so every id is predictable."""
from __future__ import annotations

import pytest
from fakes import FakeTokenizer

from deployments.chat import PromptRenderer
from kv_transfer.injection import MemoryFact, MemoryInjection
from memory_store.layout import (
    DEFAULT_SYSTEM,
    MEMORY_HEADER,
    LineTokens,
    RecalledFact,
    composition_salt,
    fact_line,
    injected_prefix,
    memory_prompt,
)

TOK = FakeTokenizer()
R = PromptRenderer(TOK)
MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "where do I live"}]
FACTS = (
    RecalledFact("f1", "User lives in Paris", ("User was born in 1990", "User likes tea"), ("c1", "c2")),
    RecalledFact("f2", "User  owns\ta cat", (), ()),
    RecalledFact("f3", "User works at a bakery", ("User lives in Paris",), ("f1",)),
)


def w(word: str) -> int:
    return TOK.word_id(word)


def prompt(messages=MSGS, facts=FACTS, *, user="alice", model="m", window=2, inject=True):
    return memory_prompt(R, messages, facts, user=user, model=model, window=window, inject=inject)


def test_fact_line_normalizes_whitespace() -> None:
    assert fact_line("  User  owns\ta\ncat ") == "- User owns a cat\n"


def test_facts_sit_back_to_back_right_after_the_anchor() -> None:
    p = prompt()
    inj = p.injection
    assert inj is not None and len(inj.facts) == 3
    ids = p.token_ids
    # the anchor is the system text and the memory header, ending with its last word
    assert ids[inj.anchor_len - 1] == w("user:")
    assert w("terse.") in ids[: inj.anchor_len]
    pos = inj.anchor_len
    for placed, f in zip(inj.facts, FACTS, strict=True):
        assert placed.fact_id == f.fact_id
        assert placed.start == pos
        assert placed.token_ids == tuple(R.text_tokens(fact_line(f.text)))
        assert ids[pos : pos + len(placed.token_ids)] == placed.token_ids
        pos += len(placed.token_ids)
    assert inj.end == pos
    assert placed.token_ids == (w("-"), w("User"), w("works"), w("at"), w("a"), w("bakery"))
    # what follows the facts is the rest of the conversation, computed by the engine
    assert ids[pos] == w("<|im_end|>")
    assert w("where") in ids[pos:] and w("where") not in ids[:pos]
    assert ids[-1] == w("<|im_start|>assistant")
    inj.check_integrity(len(ids))
    assert (inj.user, inj.model, inj.window) == ("alice", "m", 2)


def test_the_same_token_ids_in_kv_and_prompt_mode() -> None:
    kv, text = prompt(inject=True), prompt(inject=False)
    assert kv.token_ids == text.token_ids
    assert text.injection is None and text.cache_salt is None
    assert kv.injection is not None and kv.cache_salt and kv.cache_salt.startswith("baton-mem-")


def test_no_facts_means_no_injection() -> None:
    p = prompt(facts=())
    assert p.injection is None and p.cache_salt is None
    # still the memory-header layout, the same ids as in prompt mode
    assert p.token_ids == prompt(facts=(), inject=False).token_ids
    assert w("remember") in p.token_ids


def test_fact_ids_are_the_recalled_facts_in_prompt_order() -> None:
    reordered = (FACTS[2], FACTS[0], FACTS[1])
    kv = prompt(facts=reordered)
    assert kv.fact_ids == ("f3", "f1", "f2") == tuple(f.fact_id for f in kv.injection.facts)
    starts = [f.start for f in kv.injection.facts]
    assert starts == sorted(starts)  # the order the facts sit in the prompt
    # context facts (c1, c2) are not recalled facts: they never appear in fact_ids
    assert "c1" not in kv.fact_ids


def test_fact_ids_and_mode_in_kv_and_prompt_mode() -> None:
    kv, text = prompt(inject=True), prompt(inject=False)
    assert kv.fact_ids == text.fact_ids == ("f1", "f2", "f3")
    assert kv.mode == "kv" and text.mode == "prompt"


def test_no_facts_means_no_fact_ids_and_prompt_mode() -> None:
    for inject in (True, False):
        p = prompt(facts=(), inject=inject)
        assert p.fact_ids == () and p.mode == "prompt"  # nothing injected, even when KV was asked for


def test_a_fact_places_the_same_tokens_wherever_it_sits() -> None:
    alone = prompt(facts=(FACTS[2],)).injection.facts[0]
    third = prompt().injection.facts[2]
    assert alone.token_ids == third.token_ids and alone.start != third.start


def test_context_is_the_last_window_context_facts() -> None:
    f1 = prompt(window=2).injection.facts[0]
    assert f1.context_fact_ids == ("c1", "c2")
    assert f1.context_ids == tuple(R.text_tokens(fact_line("User was born in 1990")) + R.text_tokens(fact_line("User likes tea")))
    one = prompt(window=1).injection.facts[0]
    assert one.context_fact_ids == ("c2",)
    assert one.context_ids == tuple(R.text_tokens(fact_line("User likes tea")))
    assert prompt(window=5).injection.facts[0].context_fact_ids == ("c1", "c2")  # fewer available
    assert prompt(window=2).injection.facts[1].context_ids == ()  # first of its source


def test_window_zero_means_no_context() -> None:
    inj = prompt(window=0).injection
    assert inj.window == 0
    assert all(f.context_ids == () and f.context_fact_ids == () for f in inj.facts)


def test_the_users_own_system_message_is_kept_else_the_default() -> None:
    own = prompt()
    assert own.token_ids.count(w("<|im_start|>system")) == 1
    assert w("terse.") in own.token_ids and w("helpful") not in own.token_ids
    default = prompt(messages=[{"role": "user", "content": "where do I live"}])
    assert default.token_ids.count(w("<|im_start|>system")) == 1
    sys_ids = R.text_tokens(DEFAULT_SYSTEM + MEMORY_HEADER)
    assert default.token_ids[1 : 1 + len(sys_ids)] == tuple(sys_ids)
    # only the first message counts as the system prompt; a later one stays in the conversation
    later = prompt(messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "Be terse."}])
    assert later.token_ids.count(w("<|im_start|>system")) == 2
    assert later.token_ids.index(w("Be")) > later.injection.end


def test_salt_names_user_facts_window_and_context_and_is_stable() -> None:
    base = prompt().cache_salt
    assert prompt().cache_salt == base
    assert prompt(user="bob").cache_salt != base
    assert prompt(model="other").cache_salt != base
    assert prompt(window=1).cache_salt != base
    assert prompt(facts=FACTS[:2]).cache_salt != base
    assert prompt(facts=(FACTS[1], FACTS[0], FACTS[2])).cache_salt != base
    assert prompt(messages=[{"role": "system", "content": "Be kind."}, MSGS[1]]).cache_salt != base
    # the same fact encoded after another context (a predecessor deleted) is another composition
    changed = (RecalledFact("f1", FACTS[0].text, ("User likes tea",), ("c2",)), *FACTS[1:])
    assert prompt(facts=changed).cache_salt != base
    # the query (after the injected prefix) does not change the composition
    other_query = [MSGS[0], {"role": "user", "content": "what pet do I have"}]
    assert prompt(messages=other_query).cache_salt == base


def test_salt_function_matches_the_prompt() -> None:
    p = prompt()
    assert composition_salt(p.injection, p.token_ids[: p.injection.anchor_len]) == p.cache_salt


@pytest.mark.parametrize("where", [0, 1])
def test_reserved_marker_in_content_is_refused(where: int) -> None:
    msgs = [dict(m) for m in MSGS]
    msgs[where]["content"] += "\u0000baton-memory-block\u0000"
    with pytest.raises(ValueError, match="reserved"):
        prompt(messages=msgs)
    with pytest.raises(ValueError, match="reserved"):
        prompt(messages=msgs, inject=False)


# ---- MemoryInjection.check_integrity --------------------------------------------------------------

def fact(fid: str, start: int, n: int) -> MemoryFact:
    return MemoryFact(fid, start, tuple(range(10, 10 + n)))


def injection(anchor: int, *facts: MemoryFact) -> MemoryInjection:
    return MemoryInjection(user="u", anchor_len=anchor, facts=facts, window=0, model="m")


def test_integrity_accepts_a_tiling_that_leaves_a_token() -> None:
    inj = injection(5, fact("a", 5, 3), fact("b", 8, 2))
    assert inj.end == 10
    inj.check_integrity(11)


@pytest.mark.parametrize(
    "inj,prompt_len,match",
    [
        (injection(5, fact("a", 5, 3), fact("b", 9, 2)), 20, "does not continue"),  # gap
        (injection(5, fact("a", 5, 3), fact("b", 7, 2)), 20, "does not continue"),  # overlap
        (injection(5, fact("a", 6, 3)), 20, "does not continue"),  # gap after the anchor
        (injection(5, fact("a", 5, 0)), 20, "does not continue"),  # empty fact
        (injection(5, fact("a", 5, 3), fact("b", 8, 2)), 10, "leave a token"),  # reaches the end
        (injection(5, fact("a", 5, 3)), 7, "leave a token"),  # past the end
        (injection(0, fact("a", 0, 3)), 10, "anchor"),  # no anchor
    ],
)
def test_integrity_rejects(inj: MemoryInjection, prompt_len: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        inj.check_integrity(prompt_len)


# ---- recompute tail: the last facts computed instead of injected (MemoryConfig.recompute_tail_tokens) ----

def test_a_recompute_tail_injects_the_first_facts_and_leaves_the_last_to_compute() -> None:
    whole = prompt()
    lens = [len(f.token_ids) for f in whole.injection.facts]  # 6, 5, 6 words
    p = memory_prompt(R, MSGS, FACTS, user="alice", model="m", window=2, inject=True, recompute_tail=lens[-1])
    assert p.token_ids == whole.token_ids  # the same prompt: only what is injected changes
    assert [f.fact_id for f in p.injection.facts] == ["f1", "f2"] and p.injected_facts == 2
    assert p.injection.facts == whole.injection.facts[:2]
    assert p.injection.end == whole.injection.end - lens[-1]
    assert p.fact_ids == whole.fact_ids == ("f1", "f2", "f3")  # the client is still told every recalled fact
    # a different composition is injected, so its cache salt differs from the whole injection's
    assert p.cache_salt != whole.cache_salt and p.cache_salt.startswith("baton-mem-")
    # one token more than the last fact's line takes the fact before it too (whole facts only)
    q = memory_prompt(R, MSGS, FACTS, user="alice", model="m", window=2, inject=True, recompute_tail=lens[-1] + 1)
    assert [f.fact_id for f in q.injection.facts] == ["f1"] and q.injected_facts == 1


def test_a_tail_covering_every_fact_is_prompt_mode() -> None:
    p = memory_prompt(R, MSGS, FACTS, user="alice", model="m", window=2, inject=True, recompute_tail=10_000)
    assert p.injection is None and p.cache_salt is None and p.mode == "prompt" and p.injected_facts == 0
    assert p.token_ids == prompt().token_ids and p.fact_ids == ("f1", "f2", "f3")


def test_no_tail_injects_every_fact_and_counts_them() -> None:
    p = prompt()
    assert p.injected_facts == 3 and prompt(inject=False).injected_facts == 0


def test_injected_prefix_is_the_fewest_last_facts_holding_the_tail() -> None:
    facts = [MemoryFact(f"f{i}", 10 + 4 * i, tuple(range(4))) for i in range(5)]  # 4 tokens each
    assert injected_prefix(facts, 0) == tuple(facts)
    assert injected_prefix(facts, 1) == tuple(facts[:4])
    assert injected_prefix(facts, 4) == tuple(facts[:4])
    assert injected_prefix(facts, 5) == tuple(facts[:3])
    assert injected_prefix(facts, 20) == ()
    assert injected_prefix([], 8) == ()


def test_a_negative_tail_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute_tail"):
        memory_prompt(R, MSGS, FACTS, user="alice", model="m", window=2, inject=True, recompute_tail=-1)


# ---- LineTokens: fact lines' token ids remembered ----------------------------------------------

class CountingRenderer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def chat_text(self, messages):
        return R.chat_text(messages)

    def text_tokens(self, text: str) -> list[int]:
        self.calls.append(text)
        return R.text_tokens(text)


def test_line_tokens_give_the_same_prompt_and_tokenize_each_line_once() -> None:
    counting = CountingRenderer()
    lines = LineTokens(counting)
    first = memory_prompt(counting, MSGS, FACTS, user="alice", model="m", window=2, inject=True, line_tokens=lines)
    assert first == prompt()  # the same ids, injection and salt as tokenizing every line
    n_lines = len({f.text for f in FACTS} | {c for f in FACTS for c in f.context})  # "User lives in Paris" twice
    assert lines.misses == n_lines == lines.size and lines.hits == 1
    counting.calls.clear()
    again = memory_prompt(counting, MSGS, FACTS, user="alice", model="m", window=2, inject=True, line_tokens=lines)
    assert again == first and lines.misses == n_lines
    assert all(fact_line(f.text) not in counting.calls for f in FACTS)  # only the anchor and the rest were tokenized


def test_line_tokens_forget_the_least_recently_used_line() -> None:
    lines = LineTokens(R, capacity=2)
    a, b = lines("User lives in Paris"), lines("User owns a cat")
    assert a == tuple(R.text_tokens(fact_line("User lives in Paris"))) and b != a
    lines("User lives in Paris")  # a is now the most recent
    lines("User works at a bakery")  # evicts b
    assert lines.size == 2 and (lines.hits, lines.misses) == (1, 3)
    lines("User owns a cat")
    assert lines.misses == 4
    with pytest.raises(ValueError, match="capacity"):
        LineTokens(R, capacity=0)
