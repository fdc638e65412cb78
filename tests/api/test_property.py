"""Property: over thousands of generated bodies (Hypothesis) to /generate, /v1/completions and
/v1/chat/completions, the api never answers 5xx, always answers JSON (or SSE whose events
are JSON), and a normal request still succeeds afterwards. Valid bodies really run, against
the fake back end."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import fakeredis
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from shared.config import Settings
from tests.support.app import sse_events, with_api
from tests.support.backend import FakeBackend

EXAMPLES_PER_ENDPOINT = 700
WEIRD_STRINGS = [
    "",
    " ",
    "\ud800",
    "a\udfffb",
    "\x00",
    "\ufeff",
    "🎉" * 3,
    "x" * 300,
    "NaN",
    "Infinity",
    "<|im_start|>",
    "1e400",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(WEIRD_STRINGS),
)
any_json = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def mostly(valid: Any) -> Any:
    """`valid` 19 times in 20, else any JSON value."""
    return st.integers(0, 19).flatmap(lambda i: any_json if i == 0 else valid)


def _opt(**fields: Any) -> Any:
    return st.fixed_dictionaries({}, optional=fields)


def _req(required: dict[str, Any], **optional: Any) -> Any:
    return st.fixed_dictionaries(required, optional=optional)


small_int = mostly(st.integers(min_value=-2, max_value=24))
count = mostly(st.integers(min_value=0, max_value=3))
token_ids = st.lists(st.integers(min_value=-1, max_value=49_152), max_size=6)
good_ids = st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=6)
text = st.one_of(st.text(max_size=20), st.sampled_from(WEIRD_STRINGS))
good_text = st.text(min_size=1, max_size=30)
stops = mostly(st.one_of(text, st.lists(text, max_size=4)))
flag = mostly(st.booleans())

SAMPLING = {
    "temperature": mostly(st.floats(min_value=-0.1, max_value=2.1)),
    "top_p": mostly(st.floats(min_value=0, max_value=1)),
    "top_k": mostly(st.sampled_from([-1, 0, 1, 5, 50, 2**40])),
    "min_p": mostly(st.floats(min_value=0, max_value=1.1)),
    "frequency_penalty": mostly(st.floats(min_value=-2.1, max_value=2)),
    "presence_penalty": mostly(st.floats(min_value=-2, max_value=2.1)),
    "repetition_penalty": mostly(st.floats(min_value=0, max_value=2)),
    "stop": stops,
    "stop_token_ids": mostly(token_ids),
    "seed": mostly(st.integers(min_value=-(2**64), max_value=2**64)),
    "logit_bias": mostly(
        st.dictionaries(
            st.sampled_from(["5", "-1", "x", "49151", "99999"]),
            st.floats(min_value=-150, max_value=150),
            max_size=2,
        )
    ),
    "ignore_eos": flag,
    "skip_special_tokens": flag,
}
sampling_params = _opt(max_new_tokens=small_int, n=count, min_new_tokens=count, **SAMPLING)
LOGPROBS = {
    "return_logprob": flag,
    "logprob_start_len": mostly(st.integers(-2, 4)),
    "top_logprobs_num": mostly(st.integers(-1, 21)),
    "token_ids_logprob": mostly(token_ids),
    "return_text_in_logprobs": flag,
}
generate_body = st.one_of(
    _req(
        {"text": mostly(st.one_of(good_text, st.lists(good_text, min_size=1, max_size=3)))},
        sampling_params=mostly(sampling_params),
        stream=flag,
        rid=mostly(good_text),
        **LOGPROBS,
    ),
    _req(
        {"input_ids": mostly(st.one_of(good_ids, st.lists(good_ids, min_size=1, max_size=2)))},
        sampling_params=mostly(sampling_params),
        stream=flag,
        **LOGPROBS,
    ),
    _opt(
        text=any_json,
        input_ids=any_json,
        sampling_params=any_json,
        stream=any_json,
        rid=any_json,
        foo=any_json,
        **LOGPROBS,
    ),
)
STREAM_OPTIONS = mostly(_opt(include_usage=flag, continuous_usage_stats=flag))
completion_body = st.one_of(
    _req(
        {
            "prompt": mostly(
                st.one_of(good_text, st.lists(good_text, min_size=1, max_size=3), good_ids)
            )
        },
        max_tokens=small_int,
        n=count,
        logprobs=mostly(st.integers(-1, 21)),
        stream=flag,
        stream_options=STREAM_OPTIONS,
        echo=flag,
        min_tokens=count,
        model=mostly(text),
        user=mostly(text),
        **SAMPLING,
    ),
    _opt(
        prompt=any_json,
        max_tokens=any_json,
        n=any_json,
        logprobs=any_json,
        echo=any_json,
        stream=any_json,
        stream_options=any_json,
        suffix=any_json,
        best_of=any_json,
    ),
)
ROLES = st.sampled_from(["user", "system", "assistant", "user", "user"])
good_message = st.fixed_dictionaries(
    {
        "role": ROLES,
        "content": st.one_of(
            good_text,
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": good_text}),
                min_size=1,
                max_size=2,
            ),
        ),
    },
)
message = _opt(
    role=mostly(st.sampled_from(["user", "tool", "bot"])),
    content=st.one_of(text, any_json),
    name=any_json,
)
chat_body = st.one_of(
    _req(
        {"messages": mostly(st.lists(good_message, min_size=1, max_size=3))},
        max_tokens=small_int,
        max_completion_tokens=small_int,
        n=count,
        logprobs=flag,
        top_logprobs=mostly(st.integers(-1, 21)),
        stream=flag,
        stream_options=STREAM_OPTIONS,
        response_format=mostly(st.just({"type": "text"})),
        tools=mostly(st.just([])),
        chat_template_kwargs=mostly(st.just({})),
        continue_final_message=flag,
        **SAMPLING,
    ),
    _opt(
        messages=st.one_of(st.lists(message, max_size=3), any_json),
        max_tokens=any_json,
        logprobs=any_json,
        top_logprobs=any_json,
        stream=any_json,
        tools=any_json,
        tool_choice=any_json,
        response_format=any_json,
        chat_template_kwargs=any_json,
        add_generation_prompt=any_json,
    ),
)
content_types = st.sampled_from(
    ["application/json"] * 6
    + ["", "application/x-www-form-urlencoded", "text/plain", "multipart/form-data"]
)


def _raw(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def bodies(structured: Any) -> Any:
    """Mostly structured bodies; sometimes bytes, truncated JSON or a bare JSON value."""
    return st.one_of(
        structured.map(_raw),
        structured.map(_raw),
        structured.map(_raw),
        structured.map(lambda b: _raw(b)[: max(1, len(_raw(b)) // 2)]),
        any_json.map(_raw),
        st.binary(max_size=40),
    )


def check_response(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            json.loads(event)
    else:
        assert isinstance(json.loads(resp.text), dict | list), resp.text[:200]


class Harness:
    """The app, its lifespan and the fake back end on one private event loop, so that
    Hypothesis (synchronous) can drive requests through it."""

    def __init__(self, conf: Settings, tokenizer: Any) -> None:
        self.runner = asyncio.Runner()
        self.conf = conf
        self.tokenizer = tokenizer
        self.stack = contextlib.AsyncExitStack()
        self.sent = 0

    def start(self) -> httpx.AsyncClient:
        return self.runner.run(self._start())

    async def _start(self) -> httpx.AsyncClient:
        server = fakeredis.FakeServer()
        redis = fakeredis.FakeAsyncRedis(server=server)
        app = create_app(self.conf, redis=redis, tokenizer=self.tokenizer)
        await self.stack.enter_async_context(app.router.lifespan_context(app))
        backend = FakeBackend(
            fakeredis.FakeAsyncRedis(server=server), Keys_of(self.conf), self.tokenizer
        )
        task = asyncio.create_task(backend.run())
        self.stack.callback(task.cancel)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=20
        )
        await self.stack.enter_async_context(self.client)
        self.app = app
        return self.client

    def post(self, path: str, body: bytes, content_type: str) -> httpx.Response:
        headers = {"content-type": content_type} if content_type else {}
        self.sent += 1
        return self.runner.run(self.client.post(path, content=body, headers=headers))

    def close(self) -> None:
        self.runner.run(self.stack.aclose())
        self.runner.close()


def Keys_of(conf: Settings) -> Any:  # noqa: N802
    from shared.keys import Keys

    return Keys(conf.key_prefix)


def _fuzz(harness: Harness, path: str, structured: Any) -> Callable[[], None]:
    @settings(
        max_examples=EXAMPLES_PER_ENDPOINT,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(structured), content_type=content_types)
    def run(body: bytes, content_type: str) -> None:
        check_response(harness.post(path, body, content_type))

    return run


def test_generated_bodies_never_5xx(settings: Settings, tokenizer: Any) -> None:
    harness = Harness(with_api(settings, request_timeout_s=10.0), tokenizer)
    harness.start()
    try:
        for path, structured in (
            ("/generate", generate_body),
            ("/v1/completions", completion_body),
            ("/v1/chat/completions", chat_body),
        ):
            _fuzz(harness, path, structured)()
        assert harness.sent >= 2000
        ok = harness.post(
            "/v1/completions", _raw({"prompt": "hi", "max_tokens": 3}), "application/json"
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        ok = harness.post("/generate", _raw({"text": "hi"}), "application/json")
        assert ok.status_code == 200 and ok.json()["text"]
        assert harness.app.state.manager.rid_to_state == {}
    finally:
        harness.close()
