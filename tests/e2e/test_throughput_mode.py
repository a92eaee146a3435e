"""The app under Ray Serve's throughput-optimized mode, the setting README "Serving it yourself"
recommends for throughput (baton/bench/serve_modes.py): RAY_SERVE_THROUGHPUT_OPTIMIZED=1 with
direct ingress, set before `ray.init` so every Ray process of the cluster inherits it (the
controller, the proxy, every replica), while this test process keeps Serve's defaults (its own
Serve constants were imported before). Real vLLM engines, conversation policy, 1 prefill + 1
decode engine, one ingress replica.

Checked through the ingress replica's own port (direct ingress) unless said otherwise:
* a conversation's first turn is prefilled on the prefill engine and its KV moves to the decoder
  over NIXL; its second turn stays pinned there and hits that KV (gRPC handle calls between the
  deployments carry the plan and the transfer parameters);
* a streamed turn ends with [DONE];
* a malformed body gets a 400 with an OpenAI error body, and the app keeps serving;
* the HTTP proxy's port still serves the same app.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from baton.bench.cluster import settled_transfers
from baton.bench.serve_modes import THROUGHPUT_OPTIMIZED_ENV, direct_ingress_env, direct_ingress_port
from tests.e2e.conftest import e2e_args, free_port, start_app, stop_app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HTTP_TIMEOUT_S = 180.0
SYSTEM = "You are a librarian. Shelves: " + " ".join(
    f"shelf_{i} holds atlases, novels and letters from year {1800 + i} with a card for each reader." for i in range(20)
)


def _free_run(width: int = 21) -> int:
    """A port p with p + 1 … p + width - 1 free now (the direct-ingress range the cluster may use)."""
    import socket

    for _ in range(50):
        p = free_port()
        try:
            socks = []
            for q in range(p + 1, p + width):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free run of ports for direct ingress")


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    """(the ingress replica's direct URL, the HTTP proxy's URL)."""
    base = _free_run()
    args = e2e_args("conversation", decode_replicas=1, prefill_replicas=1, ingress_replicas=1)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**THROUGHPUT_OPTIMIZED_ENV, **direct_ingress_env(base)}.items():
            mp.setenv(k, v)
        try:
            proxy = start_app(args)
        except BaseException:
            import ray

            if ray.is_initialized():
                stop_app()
            raise
    try:
        direct = f"http://127.0.0.1:{direct_ingress_port(base)}"
        health = httpx.get(f"{direct}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        yield direct, proxy
    finally:
        stop_app()


def _chat(url: str, messages: list[dict[str, str]], session: str, stream: bool = False) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=HTTP_TIMEOUT_S)


def test_a_conversation_is_handed_off_once_and_stays_pinned_on_its_decoder(urls: tuple[str, str]) -> None:
    direct, _ = urls
    before = settled_transfers(direct)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which shelf holds year 1805?"}]
    first = _chat(direct, msgs, "tput-conv-1")
    assert first.status_code == 200, first.text
    assert settled_transfers(direct) - before == 1  # the first turn's KV reached the decoder over NIXL, once
    replica = first.headers["x-baton-replica"]
    msgs += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And year 1810?"}]
    second = _chat(direct, msgs, "tput-conv-1")
    assert second.status_code == 200, second.text
    assert second.headers["x-baton-replica"] == replica  # pinned
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 256  # the handed-off KV, hit on the decoder
    assert settled_transfers(direct) - before == 1  # and no second handoff


def test_a_streamed_turn_ends_with_done(urls: tuple[str, str]) -> None:
    direct, _ = urls
    r = _chat(direct, [{"role": "user", "content": "Say hello."}], "tput-conv-2", stream=True)
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])


def test_bad_input_is_a_400_with_an_openai_error_body_and_the_app_keeps_serving(urls: tuple[str, str]) -> None:
    direct, _ = urls
    r = httpx.post(f"{direct}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    ok = _chat(direct, [{"role": "user", "content": "Say hi."}], "tput-conv-3")
    assert ok.status_code == 200, ok.text


def test_the_proxy_port_still_serves(urls: tuple[str, str]) -> None:
    _, proxy = urls
    r = _chat(proxy, [{"role": "user", "content": "Say yes."}], "tput-conv-4")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
