"""BFCL function docs -> OpenAI function tools (native function-calling traces).

A BFCL doc is {"name", "description", "parameters", "response"} whose schemas use BFCL's own
type names ("dict", "float", "tuple", "any", ...). `openai_tool` maps them to JSON Schema with
BFCL's own table (bfcl_eval/constants/type_mappings.py, GORILLA_TO_OPENAPI), except that "any"
becomes no `type` at all (JSON Schema's "any value") rather than BFCL's "string". The
"response" schema describes the return value, which OpenAI tools have no place for: it is
dropped. A schema without a type (BFCL's own converter then says "string") stays untyped.

OpenAI function names must match ^[A-Za-z0-9_-]{1,64}$; BFCL names may not (other BFCL
categories use dotted names such as "math.factorial"; the multi-turn classes happen not to).
`openai_names` maps a set of BFCL names to unique valid names, reversibly: the trace records the
names that changed (ToolEnv.names, OpenAI name -> BFCL name) so the replayer can execute a call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# BFCL type name -> JSON Schema type; None: no type constraint ("any")
BFCL_TYPES: dict[str, str | None] = {
    "integer": "integer", "number": "number", "float": "number", "double": "number",
    "string": "string", "char": "string", "String": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array", "ArrayList": "array", "Array": "array",
    "Queue": "array", "Stack": "array",
    "dict": "object", "object": "object", "HashMap": "object", "Hashtable": "object",
    "byte": "integer", "short": "integer", "long": "integer", "Bigint": "integer",
    "any": None, "Any": None, "null": "null",
}
# keys of a BFCL parameter schema kept as they are (all are JSON Schema keywords)
KEPT_KEYS = ("description", "default", "enum", "minimum", "maximum", "minItems", "maxItems",
             "minLength", "maxLength", "pattern", "format", "additionalProperties")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_NAME = 64


def _json_type(kind: str) -> str | None:
    if kind not in BFCL_TYPES:
        raise ValueError(f"unknown BFCL type {kind!r}")
    return BFCL_TYPES[kind]


def json_schema(bfcl: dict[str, Any]) -> dict[str, Any]:
    """One BFCL (sub)schema -> JSON Schema; nested `properties` and `items` converted too."""
    out: dict[str, Any] = {}
    kinds = bfcl.get("type")
    mapped = [_json_type(k) for k in ([kinds] if isinstance(kinds, str) else kinds or [])]
    if mapped and None not in mapped:  # "any" anywhere in a union: no constraint
        unique = list(dict.fromkeys(mapped))
        out["type"] = unique[0] if isinstance(kinds, str) else unique
    out.update({k: bfcl[k] for k in KEPT_KEYS if k in bfcl})
    if isinstance(bfcl.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in bfcl["properties"].items()}
    if isinstance(bfcl.get("items"), dict):
        out["items"] = json_schema(bfcl["items"])
    if isinstance(bfcl.get("required"), list):
        out["required"] = list(bfcl["required"])
    return out


def openai_tool(doc: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """A BFCL function doc -> {"type": "function", "function": {name, description, parameters}}."""
    params = json_schema(doc.get("parameters") or {})
    params["type"] = "object"  # BFCL says "dict"; OpenAI wants an object schema
    params.setdefault("properties", {})
    function: dict[str, Any] = {"name": name or doc["name"]}
    if doc.get("description"):
        function["description"] = doc["description"]
    function["parameters"] = params
    return {"type": "function", "function": function}


def _valid_name(name: str) -> str:
    """BFCL's own rule ("." -> "_"), widened to every character OpenAI refuses."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:MAX_NAME] or "_"


def openai_names(bfcl_names: Iterable[str]) -> dict[str, str]:
    """BFCL name -> a unique OpenAI-valid name; valid names map to themselves.

    Invariant: the values are distinct and match NAME_RE, so inverting the dict maps a called
    name back to its BFCL function. A clash (e.g. "a.b" and "a_b") gets a suffix "_2", "_3", ...
    """
    names = list(dict.fromkeys(bfcl_names))
    taken = {n for n in names if NAME_RE.match(n)}
    out: dict[str, str] = {}
    for name in names:
        if NAME_RE.match(name):
            out[name] = name
            continue
        base, k, candidate = _valid_name(name), 1, _valid_name(name)
        while candidate in taken:
            k += 1
            candidate = f"{base[: MAX_NAME - len(str(k)) - 1]}_{k}"
        taken.add(candidate)
        out[name] = candidate
    return out


def renamed(mapping: dict[str, str]) -> dict[str, str]:
    """OpenAI name -> BFCL name for the names that changed (what a trace records)."""
    return {o: b for b, o in mapping.items() if o != b}
