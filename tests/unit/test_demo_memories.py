"""scripts/demo.sh's memory step, run as it is (bash, curl, the script's python snippet) against the
real ingress app (build_openai_app with a memory store over SQLite) and a scripted engine, served
by uvicorn on a loopback port: no Ray, no Serve, no model.

The step must name the facts it recalled (from x-baton-memories, their texts from
GET /v1/memories/{id}), report the KV-injected tokens and the answer, never fail on the model's
wording, and fail (exit 1) when the header is missing or nothing was recalled."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fakes import FakeBackend, FakeMemoryStoreHandle, FakeTokenizer

from baton.paths import REPO_ROOT
from deployments import openai_api
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.memory_api import MemoryFrontend
from deployments.metrics import RecordingMetrics
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.store import MemoryService, Recall

DEMO = REPO_ROOT / "scripts" / "demo.sh"
STEP_START = 'echo "[demo] memories:'


def memory_step() -> str:
    """The demo's memory step: from its announcement to the end of the script."""
    text = DEMO.read_text()
    assert STEP_START in text, "scripts/demo.sh has no memory step"
    return text[text.index(STEP_START):]


class Served:
    def __init__(self, tmp_path: Path, answer: list[str]):
        renderer = PromptRenderer(FakeTokenizer())
        config = MemoryConfig(embedder="hashing", mode="kv", context_window=1)
        self.service = MemoryService(config, FactStore(tmp_path / "m.sqlite3"), HashingEmbedder())
        self.backend = FakeBackend(tokens=answer, cached_tokens=45)
        frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=self.backend, max_model_len=1024,
                                  default_max_tokens=8, metrics=RecordingMetrics())

        async def health() -> dict[str, str]:
            return {"status": "ok"}

        memory = MemoryFrontend(config, FakeMemoryStoreHandle(self.service), renderer, "m")
        app = openai_api.build_openai_app(frontend, health, memory=memory)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> Served:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def run_step(self) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "URL": self.url}
        return subprocess.run(["bash", "-c", "set -euo pipefail\n" + memory_step()], env=env, capture_output=True,
                              text=True, timeout=60)


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    with Served(tmp_path, getattr(request, "param", [" Bis", "cuit", "."])) as s:
        yield s


def test_the_demo_asks_for_memories_and_reads_which_were_recalled() -> None:
    step = memory_step()
    assert '"memories": {"k": 2}' in step and '"temperature": 0' in step
    assert "x-baton-memories" in step and "/v1/memories/{i}?user=demo" in step
    assert "cached_tokens" in step and "Biscuit" in step


def test_the_memory_step_names_the_recalled_facts_and_the_answer(served: Served) -> None:
    r = served.run_step()
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "[demo] recalled 2 facts (kv mode):" in out
    assert "[demo]   - My dog is called Biscuit." in out and "[demo]   - I live in Porto and work as a baker." in out
    assert "injected as KV (or cached) 45" in out
    assert "[demo] answer: Biscuit." in out and "[demo] the answer uses the recalled fact" in out
    req = served.backend.last
    assert req.user == "demo" and req.memory is not None and req.sampling.temperature == 0


@pytest.mark.parametrize("served", [[" I'm", " sorry", " for", " your", " loss"]], indirect=True)
def test_a_wrong_answer_is_reported_never_a_failure(served: Served) -> None:
    r = served.run_step()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[demo] the model did not use it; the recalled facts were: My dog is called Biscuit.; " in r.stdout


def test_a_missing_header_fails_the_demo(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_api, "memory_headers", lambda memory: {})
    r = served.run_step()
    assert r.returncode == 1 and "no x-baton-memories header" in r.stderr


def test_nothing_recalled_fails_the_demo(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served.service, "recall", lambda *args: Recall((), ()))
    r = served.run_step()
    assert r.returncode == 1 and "no memories were recalled" in r.stderr
