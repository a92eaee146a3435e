"""Run BFCL ground-truth calls against BFCL's own simulated tool classes.

`bfcl_eval` ships the executable backends of its multi-turn categories (GorillaFileSystem,
TradingBot, ...) as in-memory Python classes. `ToolSession` owns one instance per involved class,
loaded from the entry's `initial_config`, and executes call strings such as
"mv(source='a.txt', destination='temp')" against them.

Unlike BFCL's own executor, nothing is `eval`-ed: a call is parsed with `ast`, its arguments must
be literals, and its name must be a public method of an involved class. Only the multi-turn
classes (pure in-memory simulations) are allowed; the memory and web-search backends, which write
files or reach the network, are refused. Every call runs with stdout/stderr captured and the
working directory set to a fresh temporary directory, and every exception becomes the call's
result string ("Error during execution: ..."), as in BFCL.

`execute_json(name, arguments)` runs a native (OpenAI-style) call: the arguments are JSON text
that must decode to an object (keyword arguments); the same allow-list applies.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

BACKEND = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# class name -> module of the multi-turn categories; all are in-memory simulations
ALLOWED_CLASSES = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
STATELESS_CLASSES = {"MathAPI"}
FORBIDDEN_NAMES = {"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"}


@dataclass(frozen=True)
class CallResult:
    """One call and its result text. status: "ok"; "unparseable" (not a literal call, arguments
    that are not a JSON object, or a function that is not available or allowed); "error" (the
    tool raised, or answered with BFCL's {"error": ...})."""

    call: str
    result: str
    status: Literal["ok", "unparseable", "error"] = "ok"


@contextlib.contextmanager
def sandboxed() -> Iterator[None]:
    """Capture stdout/stderr and run inside a throwaway working directory."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="baton-bfcl-") as tmp:
        sink = io.StringIO()
        try:
            os.chdir(tmp)
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            os.chdir(cwd)


def _literal(node: ast.expr) -> Any:
    return ast.literal_eval(node)


def parse_call(call: str) -> tuple[str, list[Any], dict[str, Any]]:
    """"f(1, b='x')" -> ("f", [1], {"b": "x"}); raises ValueError unless a literal-only call."""
    try:
        node = ast.parse(call.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a function call: {call!r}") from e
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {call!r}")
    if any(k.arg is None for k in node.keywords):
        raise ValueError(f"**kwargs not supported: {call!r}")
    args = [_literal(a) for a in node.args]
    kwargs = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
    return node.func.id, args, kwargs


def _stringify(value: Any) -> str:
    """As BFCL does: strings as-is, dicts as JSON (str() if not serializable), else str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class ToolSession:
    """The tool instances of one BFCL entry; state carries over from call to call."""

    def __init__(self, involved_classes: list[str], initial_config: dict, long_context: bool):
        unknown = [c for c in involved_classes if c not in ALLOWED_CLASSES]
        if unknown:
            raise ValueError(f"BFCL classes not allowed for execution: {unknown}")
        self._methods: dict[str, Callable[..., Any]] = {}
        with sandboxed():
            for name in involved_classes:
                instance = self._load(name, initial_config.get(name, {}), long_context)
                for method_name, method in inspect.getmembers(instance, inspect.ismethod):
                    if not method_name.startswith("_"):
                        self._methods[method_name] = method

    @staticmethod
    def _load(class_name: str, config: dict, long_context: bool) -> Any:
        module = importlib.import_module(f"{BACKEND}.{ALLOWED_CLASSES[class_name]}")
        instance = getattr(module, class_name)()
        if class_name not in STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(config), long_context=long_context)
        return instance

    def execute(self, call: str) -> CallResult:
        """Run one call string; any failure is returned as the result text, never raised."""
        try:
            name, args, kwargs = parse_call(call)
        except Exception as e:  # noqa: BLE001 - a bad call is the call's result
            return CallResult(call, f"Error during execution: {e}", "unparseable")
        return self._run(call, name, args, kwargs)

    def execute_json(self, name: str, arguments: str) -> CallResult:
        """Run one native call: `arguments` is JSON text of an object; never raises."""
        try:
            kwargs = json.loads(arguments)
        except (TypeError, ValueError) as e:
            return CallResult(f"{name}({arguments})",
                              f"Error during execution: arguments are not valid JSON: {e}", "unparseable")
        if not isinstance(kwargs, dict):
            return CallResult(f"{name}({arguments})", "Error during execution: arguments must be "
                              f"a JSON object, not {type(kwargs).__name__}", "unparseable")
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return self._run(f"{name}({shown})", name, [], kwargs)

    def _run(self, call: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> CallResult:
        if name in FORBIDDEN_NAMES:
            return CallResult(call, f"Error during execution: Function call {name} is not allowed.",
                              "unparseable")
        if name not in self._methods:
            return CallResult(call, f"Error during execution: Function {name} is not available.",
                              "unparseable")
        try:
            with sandboxed():
                value = self._methods[name](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the tool's failure is the tool's result
            return CallResult(call, f"Error during execution: {e}", "error")
        failed = isinstance(value, dict) and "error" in value
        return CallResult(call, _stringify(value), "error" if failed else "ok")


def _as_json_value(text: str) -> Any:
    """A result that is itself JSON (an object or list) is embedded as JSON, not re-escaped."""
    if text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def results_json(results: list[CallResult]) -> str:
    """The content of a tool turn: [{"call": ..., "result": ...}, ...] as JSON text."""
    items = [{"call": r.call, "result": _as_json_value(r.result)} for r in results]
    return json.dumps(items, ensure_ascii=False)
