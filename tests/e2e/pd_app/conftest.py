"""The application this folder's modules share: the conversation policy, 1 prefill and 2 decode
engines, 2 ingress replicas, no API keys, memories encoded with w = 1. test_serving: the OpenAI
API, bad input and a killed decoder; test_conserve: one handoff per conversation; test_tools_app:
tool calls; test_memory_app: memories and their durability across an app restart."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SharedApp, e2e_args, run_shared_app


@pytest.fixture(scope="package")
def shared_app() -> Iterator[SharedApp]:
    args = e2e_args("conversation", decode_replicas=2, prefill_replicas=1, ingress_replicas=2)
    args["memory"] = {**args["memory"], "context_window": 1, "default_k": 3}
    yield from run_shared_app(args)


@pytest.fixture
def baton_url(shared_app: SharedApp) -> str:
    return shared_app.url
