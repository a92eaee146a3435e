"""BFCL v4 multi-turn entries -> agentic Baton conversations.

Per entry (one conversation):
- system: BFCL's classic prompting system prompt with the function docs of the entry's
  `involved_classes` as JSON, minus its `excluded_function` and its held-out functions (miss_func).
- for each BFCL question turn, in order:
    user turn  (effective=false: the model is expected to answer with tool calls), then
    tool turn  (effective=true: the results of that turn's ground-truth calls, executed against
                BFCL's simulated tools; the model's reply to them is meant for the user).
  A question turn without ground-truth calls (nothing to call, e.g. a missing parameter) yields
  only its user turn, with effective=true. An empty question turn (miss_func: functions are
  added) yields a user turn carrying the added docs and BFCL's "I have updated some more
  functions..." text.
- think times come from random.Random(f"{seed}:{entry id}"): 0 before the first turn,
  user turns uniform(user_think_s), tool turns uniform(tool_think_s).

mode="native" (OpenAI function calling) instead: the docs become the conversation's `tools`
(baton/traces/bfcl_schema.py), the system prompt is NATIVE_SYSTEM_PROMPT (no docs), the turns are
the user turns only (all effective: each ends with the model's answer to the user), and
`tool_env` carries what the replayer needs to execute the model's calls live (involved classes,
initial_config, renamed tool names). miss_func's added functions arrive as the turn's
`add_tools`, with ADDED_FUNCTIONS_NATIVE as its text. No ground-truth call is executed.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from baton.traces.bfcl_schema import openai_names, openai_tool, renamed
from baton.traces.bfcl_tools import ToolSession, results_json
from baton.traces.format import Conversation, ToolEnv, Turn

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}
SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out. If the given "
    "question lacks the parameters required by the function, also point it out.\n\n"
    "You should only return the function calls in your response.\n\nIf you decide to invoke any "
    "of the function(s), you MUST put it in the format of [func_name1(params_name1="
    "params_value1, params_name2=params_value2...), func_name2(params)]. You SHOULD NOT include "
    "any other text in the response.\n\nAt each turn, you should try your best to complete the "
    "tasks requested by the user within the current turn. Continue to output functions to call "
    "until you have fulfilled the user's request to the best of your ability. When you receive "
    "the results of your calls, answer the user briefly.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n{functions}\n"
)
ADDED_FUNCTIONS_PROMPT = (
    "{functions}\nI have updated some more functions you can choose from. What about now?"
)
# Native mode: BFCL's own function-calling handlers send no system prompt at all; this one keeps
# SYSTEM_PROMPT's instructions (its first and last paragraphs, BFCL's wording plus Baton's last
# sentence) and leaves out the call format and the docs, which the tools and the template carry.
NATIVE_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out. If the given "
    "question lacks the parameters required by the function, also point it out.\n\n"
    "At each turn, you should try your best to complete the tasks requested by the user within "
    "the current turn. Continue to call tools until you have fulfilled the user's request to the "
    "best of your ability. When you receive the results of your calls, answer the user briefly."
)
ADDED_FUNCTIONS_NATIVE = "I have updated some more functions you can choose from. What about now?"


@dataclass(frozen=True)
class BfclOptions:
    categories: tuple[str, ...] = ("base",)
    n: int = 6  # conversations to build
    ids: tuple[str, ...] = ()  # if set, exactly these entry ids (in this order)
    min_user_turns: int = 1  # skip entries with fewer question turns
    max_user_turns: int | None = None  # keep only the first K question turns
    max_system_chars: int | None = None  # skip entries whose system prompt is longer
    drop_response_schema: bool = False  # drop the docs' "response" schemas (shorter prompts)
    max_tokens: int = 64
    seed: int = 0
    mode: Literal["prompting", "native"] = "prompting"  # tool docs as text, or OpenAI tools
    user_think_s: tuple[float, float] = (0.5, 2.0)
    tool_think_s: tuple[float, float] = (0.05, 0.3)
    data_dir: Path | None = None  # default: the data/ folder of the installed bfcl_eval


def bfcl_data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("bfcl_eval is not installed (pip install --no-deps bfcl-eval)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=32)
def _class_docs(data_dir: Path, class_name: str) -> tuple[dict[str, Any], ...]:
    return tuple(_read_jsonl(data_dir / "multi_turn_func_doc" / FUNC_DOC_FILES[class_name]))


def _func_docs(data_dir: Path, entry: dict[str, Any], drop_response: bool) -> list[dict[str, Any]]:
    """The docs of the entry's `involved_classes`, minus its `excluded_function` (functions BFCL
    withholds from the model for this entry: never shown, in either mode)."""
    excluded = set(entry.get("excluded_function", ()))
    docs: list[dict[str, Any]] = []
    for name in entry["involved_classes"]:
        for doc in _class_docs(data_dir, name):
            if doc["name"] not in excluded:
                docs.append({k: v for k, v in doc.items() if not (drop_response and k == "response")})
    return docs


def _uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    return round(rng.uniform(*bounds), 3)


def entry_to_conversation(
    entry: dict[str, Any], answer: dict[str, Any], data_dir: Path, opts: BfclOptions
) -> Conversation:
    """One BFCL entry and its ground truth -> one conversation (see the module docstring)."""
    if opts.mode == "native":
        return native_conversation(entry, data_dir, opts)
    entry_id = entry["id"]
    classes = list(entry["involved_classes"])
    docs = _func_docs(data_dir, entry, opts.drop_response_schema)
    held_out = {int(k): set(v) for k, v in entry.get("missed_function", {}).items()}
    hidden = set().union(*held_out.values()) if held_out else set()
    shown = [d for d in docs if d["name"] not in hidden]
    system = SYSTEM_PROMPT.format(functions=json.dumps(shown))

    questions = entry["question"][: opts.max_user_turns]
    truth = answer["ground_truth"]
    tools = ToolSession(classes, entry.get("initial_config", {}), "long_context" in entry_id)
    rng = random.Random(f"{opts.seed}:{entry_id}")
    turns: list[Turn] = []

    def add(role: Literal["user", "tool"], content: str, effective: bool,
            think: tuple[float, float]) -> None:
        think_s = _uniform(rng, think) if turns else 0.0
        turns.append(Turn(role=role, content=content, think_time_s=think_s,
                          max_tokens=opts.max_tokens, effective=effective))

    for i, question in enumerate(questions):
        calls = truth[i] if i < len(truth) else []
        if question:
            text = "\n".join(m["content"] for m in question if m.get("role") == "user")
        else:  # miss_func: the held-out functions become available at this turn
            added = [d for d in docs if d["name"] in held_out.get(i, set())]
            text = ADDED_FUNCTIONS_PROMPT.format(functions=json.dumps(added))
        add("user", text, effective=not calls, think=opts.user_think_s)
        if calls:
            results = [tools.execute(c) for c in calls]
            add("tool", results_json(results), effective=True, think=opts.tool_think_s)
    return Conversation(conversation_id=f"bfcl-{entry_id}", system=system,
                        source=f"bfcl:{entry_id}", turns=turns)


def native_conversation(entry: dict[str, Any], data_dir: Path, opts: BfclOptions) -> Conversation:
    """One BFCL entry -> a native function-calling conversation (user turns, tools, tool_env)."""
    entry_id = entry["id"]
    classes = list(entry["involved_classes"])
    docs = _func_docs(data_dir, entry, drop_response=True)
    names = openai_names(d["name"] for d in docs)
    held_out = {int(k): set(v) for k, v in entry.get("missed_function", {}).items()}
    hidden = set().union(*held_out.values()) if held_out else set()
    rng = random.Random(f"{opts.seed}:{entry_id}")
    turns: list[Turn] = []
    for i, question in enumerate(entry["question"][: opts.max_user_turns]):
        added = None
        if question:
            text = "\n".join(m["content"] for m in question if m.get("role") == "user")
        else:  # miss_func: the held-out functions become available at this turn
            text = ADDED_FUNCTIONS_NATIVE
            added = [openai_tool(d, names[d["name"]]) for d in docs if d["name"] in held_out.get(i, set())]
        turns.append(Turn(role="user", content=text, max_tokens=opts.max_tokens, add_tools=added,
                          think_time_s=_uniform(rng, opts.user_think_s) if turns else 0.0))
    env = ToolEnv(classes=classes, initial_config=entry.get("initial_config", {}),
                  long_context="long_context" in entry_id, names=renamed(names))
    return Conversation(
        conversation_id=f"bfcl-{entry_id}", system=NATIVE_SYSTEM_PROMPT, source=f"bfcl:{entry_id}",
        turns=turns, tools=[openai_tool(d, names[d["name"]]) for d in docs if d["name"] not in hidden],
        tool_env=env)


def _prompt_chars(docs: list[dict[str, Any]], opts: BfclOptions) -> int:
    """What the tool docs weigh in the prompt: the system prompt, or (native) prompt + tools."""
    if opts.mode == "native":
        return len(NATIVE_SYSTEM_PROMPT) + len(json.dumps([openai_tool(d) for d in docs]))
    return len(SYSTEM_PROMPT.format(functions=json.dumps(docs)))


def _eligible(entry: dict[str, Any], data_dir: Path, opts: BfclOptions) -> bool:
    if any(c not in FUNC_DOC_FILES for c in entry["involved_classes"]):
        return False
    if len(entry["question"]) < opts.min_user_turns:
        return False
    if opts.max_system_chars is not None:
        docs = _func_docs(data_dir, entry, opts.drop_response_schema)
        if _prompt_chars(docs, opts) > opts.max_system_chars:
            return False
    return True


def build_bfcl_trace(opts: BfclOptions = BfclOptions()) -> list[Conversation]:
    """Build conversations from the chosen BFCL multi-turn categories, in file order.

    Deterministic: the same options give the same trace. With `ids`, exactly those entries
    (filters not applied); otherwise the first `n` entries that pass the filters.
    """
    data_dir = opts.data_dir or bfcl_data_dir()
    unknown = [c for c in opts.categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown BFCL categories {unknown}; choose from {list(CATEGORIES)}")
    entries: dict[str, dict[str, Any]] = {}
    answers: dict[str, dict[str, Any]] = {}
    for cat in opts.categories:
        name = f"BFCL_v4_multi_turn_{cat}.json"
        entries.update({e["id"]: e for e in _read_jsonl(data_dir / name)})
        answers.update({a["id"]: a for a in _read_jsonl(data_dir / "possible_answer" / name)})
    if opts.ids:
        missing = [i for i in opts.ids if i not in entries]
        if missing:
            raise KeyError(f"BFCL entry ids not found in {list(opts.categories)}: {missing}")
        chosen = [entries[i] for i in opts.ids]
    else:
        eligible = (e for e in entries.values() if _eligible(e, data_dir, opts))
        chosen = list(itertools.islice(eligible, opts.n))
    return [entry_to_conversation(e, answers[e["id"]], data_dir, opts) for e in chosen]
