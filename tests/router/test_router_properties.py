"""Issue 14 section 4: generated bodies, headers and numbers against the router.

The router (with a ``priority:`` section: the chart's default, the longer path)
runs in front of two emulated vLLM engines, on a loop in a background thread;
Hypothesis sends requests from the test thread while another thread keeps
sending one well-formed request after another. Properties:

* never a 5xx for anything a client sends (the engines are healthy throughout);
* every error answer is a JSON object with ``error`` (the router's envelope, or an
  engine's own 4xx passed through);
* the concurrent well-formed client never fails;
* afterwards the router is healthy, holds no body bytes, queues nothing and has
  nothing in flight.

Bounded: ``max_examples`` modest, engines at time scale 0, ``max_tokens`` of
well-formed requests small; the module runs in well under 60 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routerkit import router_config, serve

from fleetgate.router.app import build_router
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"


class Stack:
    """Emulated engines + router on an event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.url = ""
        self.app: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.ready.wait(60):
            raise RuntimeError("stack did not start")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # reported to the test thread
            self.error = e
            self.ready.set()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()  # its self-pipe sockets, else a ResourceWarning in a later test

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        specs = [EngineSpec(kind="vllm"), EngineSpec(kind="vllm")]
        async with run_fleet(specs, "127.0.0.1", 0, model=MODEL, time_scale=0) as fleet:
            cfg = router_config(
                [(e.kind, e.url) for e in fleet.engines],
                priority={},
                limits={"max_body_bytes": 256 * 1024},
            )
            self.app = build_router(cfg)
            async with serve(self.app) as url:
                self.url = url
                async with httpx.AsyncClient(timeout=10) as c:  # wait for models
                    for _ in range(300):
                        if (await c.get(url + "/ready")).status_code == 200:
                            break
                        await asyncio.sleep(0.02)
                self.ready.set()
                await self.stop.wait()

    def close(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(20)

    def state(self) -> dict[str, Any]:
        assert not self.loop.is_closed()

        async def read() -> dict[str, Any]:
            s = self.app.state.router
            return {
                "body_bytes": s.body_bytes.used,
                "queued": len(self.app.state.admission.queue),
                "running": len(self.app.state.admission.running),
                "in_flight": sum(e.counts.in_flight for e in s.fleet),
            }

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        s.close()


class Steady:
    """A well-formed client sending request after request while the suite runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            i = 0
            while not self.done.is_set():
                i += 1
                body = {"model": MODEL, "prompt": f"steady {i}", "max_tokens": 4,
                        "stream": bool(i % 2)}  # fmt: skip
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    if r.status_code != 200 or (body["stream"] and b"[DONE]" not in r.content):
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        self.ok += 1
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))

    def __enter__(self) -> Steady:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(60)


# -- strategies -------------------------------------------------------------------------

_ascii = st.characters(min_codepoint=32, max_codepoint=126)
header_value = st.text(_ascii, max_size=300).map(str.strip)  # h11 refuses edge blanks
numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(True),
    st.text(max_size=10),
    st.none(),
)
#: ``n`` / ``logprobs`` cost the (in-process) emulated engine work in proportion: large
#: values would measure the emulator, not the router (real vLLM caps logprobs at 20).
tame = st.one_of(
    st.integers(min_value=-3, max_value=4), st.floats(allow_nan=True), st.text(max_size=5),
    st.none(), st.booleans(), st.sampled_from([10**400, 2**31]),
)  # fmt: skip
json_leaf = st.one_of(
    st.none(), st.booleans(), numbers, st.text(max_size=50),
    st.sampled_from(["\ud800", "\udfff x", "\x00", "critical", "batch"]),
)  # fmt: skip
json_any = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "nope", 5]),
     "content": st.one_of(st.text(max_size=80), json_any)},
)  # fmt: skip
body_doc = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), st.just(MODEL), json_leaf)},
    optional={
        "prompt": st.one_of(st.text(max_size=200), json_any,
                            st.lists(st.integers(-5, 70000), max_size=20)),
        "messages": st.one_of(st.lists(message, max_size=3), json_any),
        "max_tokens": numbers,
        "max_completion_tokens": numbers,
        "n": tame,
        "best_of": tame,
        "temperature": numbers,
        "top_p": numbers,
        "seed": numbers,
        "stream": st.one_of(st.booleans(), json_leaf),
        "stream_options": st.one_of(st.just({"include_usage": True}), json_any),
        "priority": json_leaf,
        "stop": st.one_of(st.text(max_size=5), json_any),
        "logprobs": tame,
        "echo": st.one_of(st.booleans(), json_leaf),
        "extra": json_any,
    },
)  # fmt: skip


def encode(doc: Any) -> bytes:
    # surrogates and NaN/Infinity are sent as a careless client would
    return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")


raw_body = st.one_of(
    body_doc.map(encode),
    json_any.map(encode),
    st.binary(max_size=300),
    st.sampled_from([b"", b"{", b"[" * 5000, b'{"a":' * 200_000, b"\xff\xfe", b"null"]),
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-fleetgate-priority": st.one_of(
            st.sampled_from(["critical", "batch", "standard", "sheddable", "5", ""]), header_value
        ),
        "x-fleetgate-tenant": header_value,
        "x-request-id": header_value,
        "content-type": st.sampled_from(
            ["application/json", "application/json; charset=utf-8", "text/plain", "", "a/b"]
        ),
        "authorization": header_value,
        "x-unknown": header_value,
    },
)


def check_answer(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        doc = resp.json()
        assert isinstance(doc, dict) and "error" in doc, resp.text[:300]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.content.endswith(b"data: [DONE]\n\n"), resp.content[-300:]
    else:
        doc = resp.json()
        assert isinstance(doc, dict) and "choices" in doc


PROPS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@PROPS
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=raw_body,
    hdrs=headers,
)
def test_generated_requests_never_get_a_5xx(
    stack: Stack, path: str, body: bytes, hdrs: dict[str, str]
) -> None:
    h = {"content-type": "application/json", **hdrs}
    with httpx.Client(timeout=30) as c:
        check_answer(c.post(stack.url + path, content=body, headers=h))


@PROPS
@given(doc=body_doc, hdrs=headers)
def test_generated_numbers_in_well_formed_bodies(
    stack: Stack, doc: dict[str, Any], hdrs: dict[str, str]
) -> None:
    doc = {**doc, "model": MODEL, "prompt": "p"}
    if isinstance(doc.get("max_tokens"), int) and not isinstance(doc["max_tokens"], bool):
        doc["max_tokens"] = doc["max_tokens"] if abs(doc["max_tokens"]) > 64 else 2
    h = {**hdrs, "content-type": "application/json"}
    with httpx.Client(timeout=30) as c:
        check_answer(c.post(stack.url + "/v1/completions", content=encode(doc), headers=h))


def test_a_concurrent_client_is_unaffected_and_the_router_is_clean_after(
    stack: Stack,
) -> None:
    """Runs the generated traffic again (fewer examples) with a steady client alongside."""
    with Steady(stack.url) as steady:
        inner = settings(PROPS, max_examples=60)(
            given(
                path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                body=raw_body,
                hdrs=headers,
            )(  # fmt: skip
                lambda path, body, hdrs: check_answer(
                    httpx.post(
                        stack.url + path,
                        content=body,
                        timeout=30,
                        headers={"content-type": "application/json", **hdrs},
                    )  # fmt: skip
                )
            )
        )
        inner()
    assert steady.failures == [] and steady.ok > 0
    with httpx.Client(timeout=10) as c:
        assert c.get(stack.url + "/health").status_code == 200
        assert c.get(stack.url + "/ready").status_code == 200
    for _ in range(100):
        state = stack.state()
        if not any(state.values()):
            break
        with contextlib.suppress(Exception):
            threading.Event().wait(0.05)
    assert state == {"body_bytes": 0, "queued": 0, "running": 0, "in_flight": 0}
    assert not math.isnan(steady.ok)
