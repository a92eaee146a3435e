"""Engine-free stand-ins shared by unit tests: a tokenizer with a chat template and a scripted
Backend. Both are deterministic, so tests can count tokens and predict every delta.

FakeTokenizer: one token per whitespace-separated word; ids are a stable hash of the word in
[FIRST_WORD_ID, vocab_size), so every id it produces is inside its vocabulary.

FakeBackend: `generate(request)` yields one GenerationDelta per scripted token; it can fail
before the first delta or after N deltas, and records what it saw:

    requests  every GenerationRequest received, in order
    outcomes  request_id -> "finished" | "closed" (consumer called aclose early) | "raised"

Serve handles as PoolBackend (deployments/backend.py) drives them; no Ray is started:

FakeResponseStream  what `handle.options(stream=True).generate.remote(req)` returns: an async
                    iterator of scripted deltas that can raise after N of them, with cancel().
FakePoolHandle      a pool's DeploymentHandle: options(**kw) returns itself; generate.remote(req)
                    records the request and returns the next scripted stream.
FakeDirectory       the conversation directory's handle: route/served/replica_failed/... each have
                    .remote(*args) returning an awaitable, as a DeploymentResponse is. It answers
                    from scripted plans, or from a real DirectoryState with an injected clock.
FakeMemoryStoreHandle
                    the memory-store actor's handle: add/list/get/recall/... .remote(*args)
                    answered by a real MemoryService; it can fail or hang per method.
"""
from __future__ import annotations

import asyncio
import inspect
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.engine.types import GenerationDelta, GenerationRequest
from deployments.directory_client import DirectoryShards
from router.directory_state import DirectoryState
from router.policy import TurnPlan

EOS_ID = 0
FIRST_WORD_ID = 3  # 0..2 are reserved for special tokens


class FakeTokenizer:
    """The slice of a Hugging Face tokenizer that PromptRenderer uses."""

    chat_template = "chatml-like (fake)"
    eos_token_id = EOS_ID

    def __init__(self, vocab_size: int = 1000):
        if vocab_size <= FIRST_WORD_ID:
            raise ValueError("vocab_size must leave room for word ids")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def word_id(self, word: str) -> int:
        return FIRST_WORD_ID + zlib.crc32(word.encode()) % (self.vocab_size - FIRST_WORD_ID)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        if tokenize:
            raise NotImplementedError("the fake renders text only (PromptRenderer tokenizes itself)")
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids = [self.word_id(w) for w in text.split()]
        if add_special_tokens:
            ids = [1] + ids
        return {"input_ids": ids}


@dataclass
class FakeBackend:
    """A scripted engine implementing the frontend's Backend protocol.

    tokens         text of each delta, one token each; the last delta is `finished`
    finish_reason  reported on the last delta
    cached_tokens  prefix-cache hits reported on every delta
    replica        set on the first delta only (as an engine replica does)
    error          raised after `error_after` deltas (0 = before the first delta)
    delay_s        sleep before each delta (lets a test interleave with a consumer)
    """

    tokens: Sequence[str] = (" Hello", " world", "!")
    finish_reason: str = "stop"
    cached_tokens: int = 0
    replica: str | None = "replica-a"
    error: BaseException | None = None
    error_after: int = 0
    delay_s: float = 0.0
    requests: list[GenerationRequest] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)

    @property
    def last(self) -> GenerationRequest:
        assert self.requests, "the backend received no request"
        return self.requests[-1]

    def closed_early(self, request_id: str | None = None) -> bool:
        rid = request_id if request_id is not None else self.last.request_id
        return self.outcomes.get(rid) == "closed"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        self.requests.append(request)
        rid = request.request_id
        self.outcomes[rid] = "started"
        try:
            for i, text in enumerate(self.tokens):
                if self.error is not None and i == self.error_after:
                    self.outcomes[rid] = "raised"
                    raise self.error
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(self.tokens) - 1
                yield GenerationDelta(
                    text=text,
                    token_ids=(FIRST_WORD_ID + i,),
                    prompt_tokens=len(request.prompt_token_ids),
                    cached_tokens=self.cached_tokens,
                    finished=last,
                    finish_reason=self.finish_reason if last else None,
                    replica=self.replica if i == 0 else None,
                )
            if self.error is not None and self.error_after >= len(self.tokens):
                self.outcomes[rid] = "raised"
                raise self.error
            self.outcomes[rid] = "finished"
        except GeneratorExit:
            self.outcomes[rid] = "closed"
            raise


# ---- Serve handles -------------------------------------------------------------------------------------


def scripted_deltas(n: int, *, replica: str | None = None, kv_transfer_params: dict[str, Any] | None = None) -> list[GenerationDelta]:
    """n deltas as an engine replica streams them: `replica` on the first, the last `finished`
    (and carrying `kv_transfer_params`, as a prefill replica's last delta does)."""
    return [
        GenerationDelta(
            text=f"t{i}",
            token_ids=(FIRST_WORD_ID + i,),
            prompt_tokens=3,
            cached_tokens=0,
            finished=i == n - 1,
            finish_reason="stop" if i == n - 1 else None,
            kv_transfer_params=kv_transfer_params if i == n - 1 else None,
            replica=replica if i == 0 else None,
        )
        for i in range(n)
    ]


class FakeResponseStream:
    """An async iterator of deltas that raises `error` before delta number `error_after`."""

    def __init__(self, deltas: Sequence[GenerationDelta], error: BaseException | None = None, error_after: int = 0):
        self._deltas = list(deltas)
        self._error, self._error_after = error, error_after
        self._i = 0
        self.cancelled = 0

    def __aiter__(self) -> FakeResponseStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self._error is not None and self._i == self._error_after:
            raise self._error
        if self._i >= len(self._deltas):
            raise StopAsyncIteration
        self._i += 1
        return self._deltas[self._i - 1]

    def cancel(self) -> None:
        self.cancelled += 1


StreamScript = Callable[[GenerationRequest], FakeResponseStream]


class FakePoolHandle:
    """A pool's DeploymentHandle as PoolBackend uses it: options(**kw) -> handle, generate.remote(req).

    `script` is one stream per call in order (the last one repeats), or a function of the request.
    """

    def __init__(self, script: Sequence[FakeResponseStream] | StreamScript):
        self._script = script
        self.options_calls: list[dict[str, Any]] = []
        self.sent: list[GenerationRequest] = []
        self.streams: list[FakeResponseStream] = []
        self.generate = self

    def options(self, **kw: Any) -> FakePoolHandle:
        self.options_calls.append(kw)
        return self

    def remote(self, request: GenerationRequest) -> FakeResponseStream:
        self.sent.append(request)
        if callable(self._script):
            stream = self._script(request)
        else:
            stream = self._script[min(len(self.sent), len(self._script)) - 1]
        self.streams.append(stream)
        return stream

    @property
    def stream(self) -> FakeResponseStream:
        assert self.streams, "no request was sent"
        return self.streams[-1]


class _RemoteMethod:
    def __init__(self, directory: FakeDirectoryHandle, name: str):
        self._directory, self._name = directory, name

    def remote(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        self._directory.calls.append((self._name, args))
        self._directory.kwargs.append((self._name, kwargs))
        # as a Serve handle does, the call starts now (a fire-and-forget report runs unawaited)
        return asyncio.ensure_future(self._directory._answer(self._name, args, kwargs))


class FakeDirectoryHandle:
    """One directory shard's Serve handle.

    plans   route() answers these in order (the last one repeats); or
    state   a DirectoryState that answers everything, at `clock()`
    errors  method name -> exception its .remote() call raises when awaited
    hang    method names whose call never completes
    calls   (method, args) of every call, in order
    """

    def __init__(
        self,
        plans: Sequence[TurnPlan] = (),
        *,
        state: DirectoryState | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        errors: dict[str, BaseException] | None = None,
        hang: Sequence[str] = (),
    ):
        self._plans = list(plans)
        self.state, self._clock = state, clock
        self.errors = dict(errors or {})
        self.hang = set(hang)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.kwargs: list[tuple[str, dict[str, Any]]] = []  # keyword arguments of each call, in the same order

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _RemoteMethod(self, name)

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == method]

    async def _answer(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if name in self.hang:
            await asyncio.Event().wait()
        if name in self.errors:
            raise self.errors[name]
        if self.state is not None and name == "report":  # as router/directory.py answers: the shards that want the complete list
            return (self.state.settings.shard,) if self.state.report(args[0], self._clock()) else ()
        if self.state is not None:  # as router/directory.py calls it: with the clock where it takes one
            method = getattr(self.state, name)
            takes_now = "now" in inspect.signature(method).parameters
            kw = kwargs or {}
            return method(*args, self._clock(), **kw) if takes_now else method(*args, **kw)
        if name == "route":
            n = len(self.called("route"))
            assert self._plans, "FakeDirectory has no plan to answer route()"
            return self._plans[min(n, len(self._plans)) - 1]
        return 0 if name == "replica_failed" else None  # conversations it held: an int, as router/directory.py answers


class FakeDirectory(DirectoryShards):
    """The conversation directory as its callers see it (the real deployments/directory_client.py)
    over one FakeDirectoryHandle shard; the shard's records (`calls`, `called`, `state`, ...) and
    its remote methods (`route.remote`, ...) read through. Takes FakeDirectoryHandle's arguments."""

    def __init__(self, plans: Sequence[TurnPlan] = (), **kw: Any):
        self.handle = FakeDirectoryHandle(plans, **kw)
        super().__init__([self.handle])

    def __getattr__(self, name: str) -> Any:
        if name == "handle":
            raise AttributeError(name)
        return getattr(self.handle, name)


# ---- the memory store's handle --------------------------------------------------------------------


class _StoreMethod:
    def __init__(self, handle: FakeMemoryStoreHandle, name: str):
        self._handle, self._name = handle, name

    def remote(self, *args: Any) -> Awaitable[Any]:
        self._handle.calls.append((self._name, args))
        return self._handle._answer(self._name, args)


class FakeMemoryStoreHandle:
    """The memory-store actor's handle (memory_store/deployment.py) as MemoryFrontend uses it:
    add/list/get/delete/delete_all/recall/get_segments/put_segments each have .remote(*args)
    returning an awaitable, answered synchronously by a real MemoryService (memory_store/store.py).

    errors  method name -> exception its call raises when awaited (e.g. a dead actor)
    hang    method names whose call never completes
    calls   (method, args) of every call, in order
    """

    def __init__(self, service: Any, *, errors: dict[str, BaseException] | None = None, hang: Sequence[str] = ()):
        self.service = service
        self.errors = dict(errors or {})
        self.hang = set(hang)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> _StoreMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _StoreMethod(self, name)

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == method]

    async def _answer(self, name: str, args: tuple[Any, ...]) -> Any:
        if name in self.hang:
            await asyncio.Event().wait()
        if name in self.errors:
            raise self.errors[name]
        return getattr(self.service, name)(*args)
