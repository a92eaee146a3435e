"""SSE lines of an OpenAI streaming chat completion -> events -> an accumulated reply."""

from baton.traces.sse import SseEvent, StreamAccumulator, error_message, parse_sse_line


def test_parse_lines():
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line("data: [DONE]") == SseEvent(done=True)
    assert parse_sse_line('data: {"a": 1}\r\n') == SseEvent(data={"a": 1})
    assert parse_sse_line('data:{"a":1}') == SseEvent(data={"a": 1})
    assert parse_sse_line("data: {oops").malformed == "{oops"
    assert parse_sse_line("data: [1]").malformed == "[1]"


def _chunk(content=None, usage=None):
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return SseEvent(data={"choices": choices, "usage": usage})


def test_accumulator_ttft_text_usage():
    acc = StreamAccumulator()
    acc.feed(SseEvent(data={"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 1.0)
    assert acc.first_token_at is None  # an empty delta is not a token
    acc.feed(_chunk("Hel"), 2.0)
    acc.feed(_chunk("lo"), 3.0)
    usage = {"prompt_tokens": 10, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 8}}
    acc.feed(_chunk(usage=usage), 4.0)
    acc.feed(SseEvent(done=True), 5.0)
    assert (acc.text, acc.first_token_at, acc.done, acc.error) == ("Hello", 2.0, True, None)
    assert (acc.usage_int("prompt_tokens"), acc.usage_int("completion_tokens"), acc.cached_tokens) == (10, 2, 8)


def test_accumulator_missing_cached_details():
    acc = StreamAccumulator()
    acc.feed(_chunk(usage={"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": None}), 0.0)
    assert acc.cached_tokens is None and acc.usage_int("prompt_tokens") == 3


def test_in_stream_error_and_malformed():
    acc = StreamAccumulator()
    acc.feed(SseEvent(data={"error": {"message": "KV lost", "type": "InternalError", "code": 500}}), 0.0)
    assert acc.error == "InternalError: KV lost"
    acc = StreamAccumulator()
    acc.feed(SseEvent(malformed="{oops"), 0.0)
    assert acc.error.startswith("malformed stream event")


def test_error_message_shapes():
    assert error_message({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}) == "BadRequestError: too long"
    assert error_message({"error": {"message": "m"}}) == "m"
    assert error_message({"error": "plain"}) == "plain"
    assert error_message({"choices": []}) is None
    assert error_message([1]) is None


def _counted(text: str, done: int | None) -> SseEvent:
    data = {"choices": [{"delta": {"content": text}}]}
    if done is not None:
        data["usage"] = {"prompt_tokens": 5, "completion_tokens": done}
    return SseEvent(data=data)


def test_tokens_per_chunk_from_continuous_usage():
    acc = StreamAccumulator()
    for t, (text, done) in enumerate([("a", 1), ("bcd", 4), ("ef", 6)]):
        acc.feed(_counted(text, done), float(t))
    acc.feed(SseEvent(data={"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}), 3.0)  # include_usage's last
    assert acc.chunk_times == [0.0, 1.0, 2.0] and acc.tokens_per_chunk == [1, 3, 2]


def test_tokens_per_chunk_unknown_without_usage_on_every_chunk():
    acc = StreamAccumulator()
    acc.feed(_counted("a", 1), 0.0)
    acc.feed(_counted("b", None), 1.0)
    assert acc.chunk_tokens == [1, None] and acc.tokens_per_chunk is None
    going_back = StreamAccumulator()  # a count that falls is not a count of this stream's tokens
    going_back.feed(_counted("a", 3), 0.0)
    going_back.feed(_counted("b", 2), 1.0)
    assert going_back.tokens_per_chunk is None
