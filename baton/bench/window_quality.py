"""`baton bench window-quality`: Metronome's quality study — sink + sliding-window KV on LoCoMo text.

SmolLM2-135M-Instruct (transformers, CPU, one thread; bf16 where the CPU computes it natively, else
fp32, as the engines resolve `dtype: auto`; `--dtype` sets it) reads long dialog text the way a bounded
Baton session does (baton/engine/realtime/session.py): tick by tick, each tick computing a chunk of C new
tokens over the context

    positions: [0, s)          [s, s+w)                     [s+w, s+w+c)
               sink: the       window: the last W tokens    chunk: computed this tick
               session's first before the chunk (KV as
               S tokens (KV as first computed, re-rotated
               first computed)  to these positions)

where s = min(S, tokens so far) and w = min(W, tokens so far - s). Each token's KV is computed once,
in the tick that brought it, and re-injected re-rotated afterwards (keys rotated by the position
change in fp32) — the serving semantics, not a recomputation of the window. Full attention is the
unbounded mode: the whole history at its true positions.

Measured for full attention and every (S, W) in {0, 4, 16} x {64, 256, 1024} (S = 0 is "window
only"):
- perplexity of one token stream (LoCoMo dialog turns joined as "Speaker: text\\n"). The headline
  perplexity scores only targets past position max(S) + max(W) + C, where every bounded config has
  started to slide (before that all configs equal full attention); the all-token perplexity is in
  the JSON too;
- repetition of free-running greedy generation: a dialog prompt is fed in ticks of C tokens, then
  each tick computes the previous tick's reply and generates R new tokens over the same context rule;
  distinct-4 = unique / total token 4-grams of the generated text (low = degeneration), and the
  generations' perplexity judged by full attention given the prompt (high = incoherent text, which
  distinct-4 alone would score as diverse).
All bounded configs run as one batch (left-padded contexts), so every config sees the same stream.
The recommended default is the lowest perplexity with S + W <= KV_BUDGET tokens.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
LOCOMO = ROOT.parent / "shared" / "data" / "locomo"
SINKS = (0, 4, 16)
WINDOWS = (64, 256, 1024)
CHUNK = 16  # tokens computed per tick (C)
REPLY = 8  # tokens generated per tick in the repetition test (R)
KV_BUDGET = 512  # S + W tokens per session allowed for the recommended default
PPL_CONV = "conv-26"
GEN_CONVS = ("conv-30", "conv-41", "conv-42", "conv-43")


@dataclass(frozen=True)
class Workload:
    stream_tokens: int
    prompt_tokens: int
    gen_tokens: int
    prompts: int


QUICK = Workload(stream_tokens=2560, prompt_tokens=384, gen_tokens=128, prompts=2)
FULL = Workload(stream_tokens=8000, prompt_tokens=1280, gen_tokens=256, prompts=3)


@dataclass(frozen=True)
class Config:
    sinks: int
    window: int | None  # None: full attention (unbounded)

    @property
    def name(self) -> str:
        return "full" if self.window is None else f"S{self.sinks}_W{self.window}"


def context_indices(cfg: Config, n: int) -> list[int]:
    """Tokens a tick sees before its chunk when n tokens came before: sinks ∪ last W, in order.

    Invariant: sinks (the first S tokens) are never evicted; the window never overlaps them.
    """
    if cfg.window is None:
        return list(range(n))
    s = min(cfg.sinks, n)
    #   [0, s) sink          [max(s, n - W), n) window
    return list(range(s)) + list(range(max(s, n - cfg.window), n))


def _dialog_lines(conv: str) -> list[str] | None:
    path = LOCOMO / f"{conv}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    sessions = sorted((k for k in data if re.fullmatch(r"session_\d+", k) and isinstance(data[k], list)),
                      key=lambda k: int(k.split("_")[1]))
    return [f"{t['speaker']}: {t['text']}\n" for k in sessions for t in data[k]]


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted token indices as half-open runs of consecutive indices: [0,1,2,7,8] -> [(0,3), (7,9)]."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class BatchedSessions:
    """The KV of several bounded sessions that read the same tokens, one row per config.

    Owns, per row, the KV of every token it has computed (as computed: post-RoPE at the position it
    had then) and that position; `tick` composes each row's context by its rule, re-rotates it to
    contiguous positions, computes the new tokens over it as one left-padded batch and stores their
    KV. Full attention (window None) is a row whose context is its whole history, never re-rotated.
    """

    def __init__(self, model: Any, configs: list[Config], max_tokens: int) -> None:
        import torch

        self.model, self.configs = model, configs
        cfg = model.config
        self.layers, self.kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (len(configs), self.layers, self.kv_heads, max_tokens, self.head_dim)
        self.keys = torch.zeros(shape, dtype=model.dtype)
        self.values = torch.zeros(shape, dtype=model.dtype)
        self.pos = torch.zeros(len(configs), max_tokens, dtype=torch.long)  # position each KV was computed at
        self.n = 0  # tokens whose KV every row holds
        self.inv_freq = model.model.rotary_emb.inv_freq.float()

    def _rotate_into(self, out: Any, k: Any, delta: Any) -> None:
        """out[...] = post-RoPE keys k [L, H, T, D] rotated by per-token position change delta [T].

        Llama pairing (dimension i with i + D/2), computed in fp32 and rounded once to out's dtype.
        """
        freqs = delta.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        half = k.shape[-1] // 2
        k1, k2 = k[..., :half].float(), k[..., half:].float()
        out[..., :half] = k1 * cos - k2 * sin
        out[..., half:] = k2 * cos + k1 * sin

    def _context(self) -> tuple[Any, Any, list[int]]:
        """DynamicCache of every row's context (left-padded to the longest), 2D mask, lengths."""
        import torch
        from transformers.cache_utils import DynamicCache

        idx = [context_indices(c, self.n) for c in self.configs]
        lengths = [len(i) for i in idx]
        lmax = max(lengths)
        b = len(self.configs)
        shape = (self.layers, b, self.kv_heads, lmax, self.head_dim)
        k_all, v_all = torch.zeros(shape, dtype=self.keys.dtype), torch.zeros(shape, dtype=self.keys.dtype)
        mask = torch.zeros(b, lmax, dtype=torch.long)
        for r, ids in enumerate(idx):
            if not ids:
                continue
            #   [0, lmax - len) padding     [lmax - len, lmax) context = runs of consecutive tokens
            pad = col = lmax - len(ids)
            mask[r, pad:] = 1
            for a, z in _runs(ids):
                dst = slice(col, col + z - a)
                # the new contiguous position (column - padding) minus the position it was computed at
                delta = torch.arange(col - pad, col - pad + z - a) - self.pos[r, a:z]
                if bool((delta != 0).any()):
                    self._rotate_into(k_all[:, r, :, dst], self.keys[r, :, :, a:z], delta)
                else:
                    k_all[:, r, :, dst] = self.keys[r, :, :, a:z]
                v_all[:, r, :, dst] = self.values[r, :, :, a:z]
                col += z - a
        cache = DynamicCache(config=self.model.config)
        for layer in range(self.layers):
            cache.update(k_all[layer], v_all[layer], layer)
        return cache, mask, lengths

    def tick(self, new: list[list[int]], reply: int = 0) -> tuple[Any, list[list[int]]]:
        """Compute each row's `new` tokens (same count in every row); greedily generate `reply` per row.

        Returns the logits over `new` [B, len(new), V] (fp32) and each row's generated tokens. The
        new tokens' KV is stored; the generated tokens' KV is not (as in serving, a reply is
        computed as part of the next tick).
        """
        import torch

        cache, mask, lengths = self._context()
        b, c, lmax = len(self.configs), len(new[0]), mask.shape[1]
        ids = torch.tensor(new)
        pos = torch.tensor([[ln + i for i in range(c)] for ln in lengths])
        mask = torch.cat((mask, torch.ones(b, c, dtype=torch.long)), dim=1)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = out.logits.float()
            for layer in range(self.layers):
                lk, lv = cache.layers[layer].keys, cache.layers[layer].values
                self.keys[:, layer, :, self.n:self.n + c] = lk[:, :, lmax:lmax + c]
                self.values[:, layer, :, self.n:self.n + c] = lv[:, :, lmax:lmax + c]
            self.pos[:, self.n:self.n + c] = pos
            self.n += c
            generated: list[list[int]] = [[] for _ in range(b)]
            nxt = logits[:, -1].argmax(-1)
            for step in range(reply):
                for r in range(b):
                    generated[r].append(int(nxt[r]))
                if step == reply - 1:
                    break
                pos = pos[:, -1:] + 1
                mask = torch.cat((mask, torch.ones(b, 1, dtype=torch.long)), dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                                 past_key_values=out.past_key_values, use_cache=True)
                nxt = out.logits[:, -1].float().argmax(-1)
        return logits, generated


def _nll(logits: Any, targets: list[int]) -> Any:
    import torch

    lp = torch.log_softmax(logits[..., : len(targets), :], dim=-1)
    return -lp.gather(-1, torch.tensor(targets).expand(lp.shape[0], -1)[..., None])[..., 0]


def _full_nll(model: Any, stream: list[int]) -> Any:
    """Per-target NLL under full attention: one causal pass, in 512-token pieces over a growing cache."""
    import torch
    from transformers.cache_utils import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        for a in range(0, len(stream) - 1, 512):
            piece = stream[a:a + 512]
            res = model(input_ids=torch.tensor([piece]), past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(a, a + len(piece))[None])
            out.append(_nll(res.logits.float(), stream[a + 1:a + 1 + len(piece)])[0])
    return torch.cat(out)


def _stream_nll(model: Any, configs: list[Config], stream: list[int]) -> Any:
    """Per-target NLL [B, len(stream) - 1] for every bounded config, tick by tick."""
    import torch

    sessions = BatchedSessions(model, configs, len(stream))
    out = []
    for a in range(0, len(stream) - 1, CHUNK):
        logits, _ = sessions.tick([stream[a:a + CHUNK]] * len(configs))
        out.append(_nll(logits, stream[a + 1:a + 1 + CHUNK]))
    return torch.cat(out, dim=1)


def _generate(model: Any, configs: list[Config], prompt: list[int], gen_tokens: int) -> list[list[int]]:
    """Free-running greedy generation per config: the prompt in ticks of CHUNK tokens, then each tick
    computes the row's previous reply and generates REPLY new tokens."""
    sessions = BatchedSessions(model, configs, len(prompt) + gen_tokens)
    b = len(configs)
    pieces = [prompt[a:a + CHUNK] for a in range(0, len(prompt), CHUNK)]
    for piece in pieces[:-1]:
        sessions.tick([piece] * b)
    _, reply = sessions.tick([pieces[-1]] * b, reply=REPLY)
    out = [list(r) for r in reply]
    while len(out[0]) < gen_tokens:
        _, reply = sessions.tick(reply, reply=REPLY)
        for r in range(b):
            out[r] += reply[r]
    return [o[:gen_tokens] for o in out]


def _judged_ppl(model: Any, prompt: list[int], gen: list[int]) -> float:
    """Perplexity of generated tokens under full attention given the prompt: high = incoherent text
    (which distinct-4 alone scores as "diverse")."""
    import math

    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen])).logits.float()[0, len(prompt) - 1:-1]
    return math.exp(float(_nll(logits[None], gen)[0].mean()))


def distinct_n(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def _gen_prompt(tok: Any, conv: str, n_tokens: int) -> list[int] | None:
    """Dialog turns of `conv` up to ~n_tokens, ending with the next speaker's name so the model goes on."""
    lines = _dialog_lines(conv)
    if not lines:
        return None
    text, used = "", 0
    for line in lines:
        if used >= n_tokens:
            return tok.encode(text + line.split(":", 1)[0] + ":", add_special_tokens=False)
        text += line
        used += len(tok.encode(line, add_special_tokens=False))
    return None


def _recommend(ppl: dict[str, float], distinct: dict[str, float]) -> tuple[Config, str]:
    fits = [Config(s, w) for s in SINKS for w in WINDOWS if s + w <= KV_BUDGET]
    best = min(fits, key=lambda c: ppl[c.name])
    alone = ppl[Config(0, best.window).name]
    why = (f"lowest perplexity with S + W <= {KV_BUDGET} tokens: {ppl[best.name]:.2f} vs {ppl['full']:.2f} full "
           f"(+{100 * (ppl[best.name] / ppl['full'] - 1):.1f} %) and {alone:.2f} window only at W={best.window}; "
           f"distinct-4 {distinct[best.name]:.3f} vs {distinct['full']:.3f} full")
    return best, why


def _plot(ppl: dict[str, float], distinct: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, vals, label in ((axes[0], ppl, "perplexity (sliding region)"), (axes[1], distinct, "distinct-4 of greedy generation")):
        for s in SINKS:
            ax.plot(WINDOWS, [vals[Config(s, w).name] for w in WINDOWS], "o-", label="window only" if s == 0 else f"S={s} sinks")
        ax.axhline(vals["full"], color="k", ls="--", label="full attention")
        ax.set_xscale("log", base=2)
        ax.set_xticks(WINDOWS, [str(w) for w in WINDOWS])
        ax.set_xlabel("window W (tokens)")
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle("SmolLM2-135M on LoCoMo dialogs: sink + sliding-window KV (re-rotated), chunks of 16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(quick: bool, out_dir: Path, dtype: str = "auto") -> dict[str, Any]:
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from baton.engine.args import engine_dtype
    from baton.engine.vllm_engine import native_cpu_bf16

    work = QUICK if quick else FULL
    lines = _dialog_lines(PPL_CONV)
    if lines is None or not MODEL.exists():
        print(f"[window-quality] skipped: needs {LOCOMO}/{PPL_CONV}.json and the model at {MODEL}")
        return {"skipped": True}
    torch.set_num_threads(1)  # one core: the matmuls are fastest uncontended; the host is shared
    dtype = engine_dtype(dtype, on_gpu=False, cpu_bf16=native_cpu_bf16())  # emulated bf16 (AVX2) is several times slower
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    tok.model_max_length = 10**9  # the stream is cut to work.stream_tokens below
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, dtype), local_files_only=True).eval()
    stream: list[int] = []
    for conv in (PPL_CONV, *GEN_CONVS[::-1]):  # a second conversation only if the first is too short
        stream += tok.encode("".join(_dialog_lines(conv) or []), add_special_tokens=False)
        if len(stream) >= work.stream_tokens:
            break
    stream = stream[:work.stream_tokens]
    bounded = [Config(s, w) for s in SINKS for w in WINDOWS]
    start = max(SINKS) + max(WINDOWS) + CHUNK  # from this target on, every bounded config has slid
    print(f"[window-quality] {len(stream)} tokens of LoCoMo {PPL_CONV} ({dtype}); ticks of {CHUNK}; scoring targets >= {start}")

    full = _full_nll(model, stream)
    nll = _stream_nll(model, bounded, stream)
    t_ppl = time.perf_counter() - t0
    ppl = {"full": math.exp(full[start - 1:].mean())}
    ppl_all = {"full": math.exp(full.mean())}
    warmup_dnll = {}
    for r, c in enumerate(bounded):
        ppl[c.name] = math.exp(nll[r, start - 1:].mean())
        ppl_all[c.name] = math.exp(nll[r].mean())
        # while the history fits in S + W a bounded row must equal full attention
        # (batched, padded ticks vs one pass differ by rounding only — this is the noise floor)
        d = nll[r, : c.sinks + c.window] - full[: c.sinks + c.window]
        warmup_dnll[c.name] = {"max_abs": float(d.abs().max()), "ppl_ratio": math.exp(d.mean())}
    worst = max(abs(v["ppl_ratio"] - 1) for v in warmup_dnll.values())
    print(f"[window-quality] perplexity done in {t_ppl:.0f}s; before sliding every config must equal full "
          f"attention: perplexity within {100 * worst:.2f} % ({dtype} rounding), max |Δnll| "
          f"{max(v['max_abs'] for v in warmup_dnll.values()):.3f}")

    configs = [Config(0, None), *bounded]
    gens: dict[str, list[list[int]]] = {c.name: [] for c in configs}
    judged: dict[str, list[float]] = {c.name: [] for c in configs}
    prompts = [p for p in (_gen_prompt(tok, c, work.prompt_tokens) for c in GEN_CONVS) if p][: work.prompts]
    for p in prompts:
        for c, g in zip(configs, _generate(model, configs, p, work.gen_tokens), strict=True):
            gens[c.name].append(g)
            judged[c.name].append(_judged_ppl(model, p, g))
    distinct = {k: sum(distinct_n(g) for g in v) / len(v) for k, v in gens.items()}
    gen_ppl = {k: math.exp(sum(math.log(x) for x in v) / len(v)) for k, v in judged.items()}
    same_as_full = {k: sum(g == f for g, f in zip(v, gens["full"], strict=True)) for k, v in gens.items()}
    t_all = time.perf_counter() - t0
    print(f"[window-quality] generation: {len(prompts)} prompts of ~{work.prompt_tokens} tokens, "
          f"{work.gen_tokens} greedy tokens each ({REPLY} per tick); done at {t_all:.0f}s")

    print(f"[window-quality] {'config':<12} {'S+W':>5} {'ppl(slid)':>10} {'ppl(all)':>9} {'distinct-4':>10} "
          f"{'gen ppl':>8} {'=full gens':>10}")
    for c in configs:
        kv = "all" if c.window is None else str(c.sinks + c.window)
        print(f"[window-quality] {c.name:<12} {kv:>5} {ppl[c.name]:>10.2f} {ppl_all[c.name]:>9.2f} "
              f"{distinct[c.name]:>10.3f} {gen_ppl[c.name]:>8.2f} {same_as_full[c.name]:>7}/{len(prompts)}")
    print("[window-quality] ppl(slid): targets where every bounded config slides; gen ppl: the generations judged "
          "by full attention (geometric mean; high = incoherent); =full gens: greedy tokens identical to full")
    best, why = _recommend(ppl, distinct)
    print(f"[window-quality] recommended default: S={best.sinks} W={best.window} — {why}")
    sample = tok.decode(gens[Config(0, 64).name][0][:48]).replace("\n", " | ")
    print(f"[window-quality] sample, window only W=64: {sample!r}")

    result = {"ppl_full": ppl["full"], "best_S": best.sinks, "best_W": best.window, "ppl_best": ppl[best.name],
              "ppl_window_only_same_W": ppl[Config(0, best.window).name]}
    report = {"quick": quick, "dtype": dtype, "workload": work.__dict__, "chunk": CHUNK, "reply_per_tick": REPLY, "kv_budget": KV_BUDGET,
              "stream_conversation": PPL_CONV, "stream_tokens": len(stream), "scored_from_target": start,
              "ppl_sliding_region": ppl, "ppl_all_tokens": ppl_all, "distinct4": distinct, "generation_ppl_judged_by_full": gen_ppl,
              "generations_equal_to_full": same_as_full, "prompts": len(prompts),
              "before_sliding_vs_full": warmup_dnll, "recommended": {"S": best.sinks, "W": best.window, "why": why},
              "seconds": {"perplexity": t_ppl, "total": t_all}, "result": result}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "window_quality.json").write_text(json.dumps(report, indent=2))
    _plot(ppl, distinct, out_dir / "window_quality.png")
    print(f"[window-quality] wrote {out_dir / 'window_quality.json'} and {out_dir / 'window_quality.png'}")
    print(f"RESULT ppl_full={ppl['full']:.3f} best_S={best.sinks} best_W={best.window} ppl_best={ppl[best.name]:.3f} "
          f"ppl_window_only_same_W={result['ppl_window_only_same_W']:.3f}")
    return report
