"""Incremental tokenization of conversations (deployments/token_prefix.py, deployments/chat.py):
every turn's ids equal the whole text's tokenization, on the model's own tokenizer (SmolLM2,
provisioned by the set-up) and on tokenizers of other families built here (SentencePiece-style
Metaspace with each prepend scheme, GPT-2/Llama-3-style byte level); a tokenizer that merges
across special tokens is caught by the probe and gets no cache. No engine."""
from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from baton.paths import REPO_ROOT
from deployments.chat import PromptRenderer
from deployments.protocol import ChatMessage
from deployments.token_prefix import PrefixTokens, probe

MODEL_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
WORDS = ["hello", " world", "  ", "\n", "\n\n", "\t", "123", "4567", "ümlaut", "数字", "{\"a\": 1}", "!!", "?", "tool_call", " ", "x"]


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def conversation(rng: random.Random, turns: int) -> list[list[ChatMessage]]:
    """The message lists a client sends turn after turn (each the last plus a reply and a question)."""
    msgs = [ChatMessage(role="system", content="You are a helper." + text_of(rng, 30))]
    out = []
    for t in range(turns):
        content = text_of(rng, rng.randint(1, 40)) + (" <|im_start|>user fake" if t == 2 else "")  # a special token typed in content
        msgs.append(ChatMessage(role="user", content=content))
        out.append(list(msgs))
        msgs.append(ChatMessage(role="assistant", content=text_of(rng, rng.randint(0, 30))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_every_turn_of_a_conversation_tokenizes_as_the_whole_text_does(tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    r = PromptRenderer(tok, incremental=True)
    whole = PromptRenderer(tok)
    assert r.incremental and not whole.incremental
    for sent in conversation(rng, 8):
        assert r.chat_tokens(sent, key="ana\x00s1") == whole.chat_tokens(sent)
    snap = r.prefix_snapshot()
    assert snap is not None and snap["hits"] == 7 and snap["misses"] == 1, snap


def test_an_edited_history_or_another_key_is_tokenized_whole_and_still_right(tok: Any) -> None:
    rng = random.Random(7)
    r = PromptRenderer(tok, incremental=True)
    turns = conversation(rng, 4)
    for sent in turns:
        r.chat_tokens(sent, key="k")
    edited = [turns[-1][0], ChatMessage(role="user", content="an edited first question"), *turns[-1][2:]]
    assert r.chat_tokens(edited, key="k") == PromptRenderer(tok).chat_tokens(edited)
    assert r.chat_tokens(turns[-1], key=None) == PromptRenderer(tok).chat_tokens(turns[-1])
    snap = r.prefix_snapshot()
    assert snap is not None and snap["misses"] == 2  # the first turn and the edit; key=None is not looked up


def test_a_text_that_continues_the_kept_part_without_a_special_token_is_not_cut_there(tok: Any) -> None:
    special = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    whole = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])
    cache = PrefixTokens(whole, special)
    cache.tokens("k", "abc def<|im_start|>user")  # keeps "abc def"
    for text in ("abc define", "abc def ghi<|im_start|>x", "abc def"):  # BPE would merge across the old cut
        assert cache.tokens("k", text) == whole(text), text
    assert cache.totals["hits"] == 0


def _trained(pre: Any) -> tuple[Any, dict[str, int]]:
    specials = ["<s>", "</s>", "<|eot|>", "<|start_header_id|>"]
    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre
    corpus = [text_of(random.Random(i), 40) for i in range(200)]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", *specials]))
    return tk, {s: tk.token_to_id(s) for s in specials}


@pytest.mark.parametrize("pre", [pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.Metaspace(prepend_scheme="always"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False), pre_tokenizers.ByteLevel(add_prefix_space=True)],
                         ids=["metaspace-first", "metaspace-always", "bytelevel", "bytelevel-prefix-space"])
def test_other_tokenizer_families_tokenize_each_turn_as_whole(pre: Any) -> None:
    tk, special = _trained(pre)
    whole = lambda s: tk.encode(s, add_special_tokens=False).ids
    cache = PrefixTokens(whole, special)
    rng = random.Random(3)
    text = "<s>" + text_of(rng, 20)
    for _ in range(12):  # a growing text, each step appending a special token and words
        text += rng.choice(list(special)) + text_of(rng, rng.randint(0, 15))
        assert cache.tokens("k", text) == whole(text)
    assert cache.totals["hits"] >= 10
    cache.check_integrity()


class Wrapped:
    """A tokenizer that behaves as `inner` but for what a subclass overrides."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.chat_template = inner.chat_template
        self.added_tokens_decoder = inner.added_tokens_decoder

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        return self.inner(text, **kw)


def test_a_tokenizer_that_merges_across_special_tokens_fails_the_probe_and_gets_no_cache(tok: Any) -> None:
    class Merging(Wrapped):
        """SmolLM2's tokenizer, but it drops every <|im_start|> but a text's first:
        tokens(a + b) != tokens(a) + tokens(b) at a cut before one."""

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            ids = list(self.inner(text, add_special_tokens=False)["input_ids"])
            start = self.inner.convert_tokens_to_ids("<|im_start|>")
            return {"input_ids": [i for j, i in enumerate(ids) if not (i == start and j > 0)]}

    r = PromptRenderer(Merging(tok), incremental=True)
    assert not r.incremental  # the probe saw the difference
    sent = conversation(random.Random(1), 3)[-1]
    assert r.chat_tokens(sent, key="k") == list(Merging(tok)(r.chat_text(r.template_messages(sent)))["input_ids"])


def test_the_cache_is_bounded_in_keys_and_characters() -> None:
    special = {"<s>": 1}
    tokenize = lambda s: [1 if c == "\0" else ord(c) for c in s.replace("<s>", "\0")]
    cache = PrefixTokens(tokenize, special, capacity=3, max_chars=25)
    for k in range(5):
        assert cache.tokens(f"k{k}", "abcdefghij<s>x") == tokenize("abcdefghij<s>x")
    snap = cache.snapshot()
    assert snap["keys"] == 2 and snap["chars"] == 20 and snap["evicted"] == 3  # 25 chars hold two 10-char prefixes
    cache.check_integrity()
    assert probe(tokenize, special, ["a<s>b", "a<s>b<s>c", "a<s>b<s>c<s>d"])
    assert not probe(tokenize, special, ["ab", "abc"])  # no special token: nothing to cut at, no cache
    with pytest.raises(ValueError):
        PrefixTokens(tokenize, special, capacity=0)


def test_a_template_that_cannot_render_the_probe_turns_the_cache_off_instead_of_failing_the_start(tok: Any) -> None:
    class NoSystem(Wrapped):
        """SmolLM2's tokenizer under a template that refuses system messages (as some models' do)."""

        def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
            if any(m["role"] == "system" for m in messages):
                raise ValueError("System role not supported")
            return self.inner.apply_chat_template(messages, **kw)

    r = PromptRenderer(NoSystem(tok), incremental=True)
    assert not r.incremental and r.prefix_snapshot() is None
    sent = [ChatMessage(role="user", content="hello there")]
    assert r.chat_tokens(sent, key="k") == PromptRenderer(tok).chat_tokens(sent)
