"""The emulated vLLM server against the real vLLM 0.32 recordings.

We test these aspects: response shapes (keys, types, status, headers) of every
recorded endpoint, SSE framing (one event per HTTP chunk, [DONE], fingerprint
placement, first chat chunk), the recorded error cases, disconnect -> abort
(running falls, ``abort`` not counted), priority order through HTTP, and that
bad input never crashes or hangs the server.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from recordings import VLLM_032

from fleetgate.sim.fleet import EngineSpec, Fleet, run_fleet

FIX = VLLM_032
MODEL = "tiny-llama"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIX / name).read_text())
    return data


def shape(obj: Any) -> Any:
    """Keys and value types, recursively (values themselves are run-specific)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    if isinstance(obj, bool):
        return "bool"
    if isinstance(obj, int | float):
        return "number"
    return type(obj).__name__


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    spec = EngineSpec(kind="vllm", overrides={"queue_policy": "priority"})
    async with run_fleet([spec], "127.0.0.1", 0, model=MODEL, time_scale=1.0) as f:
        yield f


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.engines[0].url, timeout=10) as c:
        yield c


async def raw_request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    """One request on a fresh socket; every byte of the response (server closes)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    hdrs = {"Host": f"{host}:{port}", "Connection": "close", **(headers or {})}
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    return data


def dechunk(raw: bytes) -> tuple[bytes, list[bytes]]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    chunks = []
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    return head, chunks


def header_names(head: bytes) -> list[str]:
    """Header names in wire order; ``connection`` is left out (our client sends close)."""
    names = [line.split(b":")[0].decode().lower() for line in head.split(b"\r\n")[1:]]
    return [n for n in names if n != "connection"]


def events(chunks: list[bytes]) -> list[Any]:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n"), c
        assert c.count(b"\n\n") == 1, "one SSE event per HTTP chunk"
        payload = c[6:-2]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def test_health_models_version_shapes(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert "content-type" not in r.headers and r.headers["content-length"] == "0"
    r = await client.get("/v1/models")
    want = fixture("models.json")["response"]["body_json"]
    assert shape(r.json()) == shape(want)
    assert r.json()["data"][0]["id"] == MODEL and r.json()["data"][0]["owned_by"] == "vllm"
    r = await client.get("/version")
    assert r.json() == {"version": "0.33.0"}


@pytest.mark.parametrize(
    ("name", "path"),
    [
        pytest.param("completions_nonstream.json", "/v1/completions", id="completion"),
        pytest.param("chat_nonstream.json", "/v1/chat/completions", id="chat"),
        pytest.param("completions_return_token_ids.json", "/v1/completions", id="cmpl-ids"),
        pytest.param("chat_return_token_ids.json", "/v1/chat/completions", id="chat-ids"),
        pytest.param("completions_prompt_token_ids.json", "/v1/completions", id="prompt-ids"),
        pytest.param("missing_model_accepted.json", "/v1/completions", id="no-model"),
        pytest.param("extra_unknown_field.json", "/v1/completions", id="extra-field"),
        pytest.param("priority_numeric_string.json", "/v1/completions", id="priority-str-5"),
    ],
)
async def test_nonstream_shapes_match_fixture(
    client: httpx.AsyncClient, name: str, path: str
) -> None:
    rec = fixture(name)
    body = json.loads(rec["request"]["body"])
    r = await client.post(path, json=body)
    want = rec["response"]["body_json"]
    assert r.status_code == 200
    got = r.json()
    # prompt_tokens_details is on by default in the emulator (the operator sets it)
    got["usage"]["prompt_tokens_details"] = None
    assert shape(got) == shape(want)
    assert list(got) == list(want), "key order as recorded"
    assert got["model"] == MODEL and got["usage"]["completion_tokens"] >= 1


async def test_prompt_tokens_details_null_when_disabled() -> None:
    spec = EngineSpec(kind="vllm", enable_prompt_tokens_details=False)
    async with run_fleet([spec], "127.0.0.1", 0, model=MODEL) as f, httpx.AsyncClient() as c:
        r = await c.post(
            f.engines[0].url + "/v1/completions",
            json={"prompt": "The prefix cache is warm.", "max_tokens": 4},
        )
        assert r.json()["usage"]["prompt_tokens_details"] is None
    async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model=MODEL) as f:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                f.engines[0].url + "/v1/completions",
                json={"prompt": "The prefix cache is warm.", "max_tokens": 4},
            )
        assert r.json()["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_tokens_details_keys_like_vllm(
    client: httpx.AsyncClient, stream: bool
) -> None:
    """Fix-list F2: three keys in responses (created_cache_tokens null on completions, an
    int on chat); stream usage chunks keep only the non-null ones."""
    # the fleet fixture's engine has 16-token blocks; this prompt spans several
    prompt = " ".join(f"alpha{i} beta" for i in range(40))
    extra: dict[str, Any] = {"max_tokens": 2, "stream": stream}
    if stream:
        extra["stream_options"] = {"include_usage": True}

    async def details(path: str) -> dict[str, Any]:
        if path == "/v1/completions":
            body = {"prompt": prompt, **extra}
        else:
            body = {"messages": [{"role": "user", "content": prompt}], **extra}
        r = await client.post(path, json=body)
        assert r.status_code == 200
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x[6:7] == "{"]
            got: dict[str, Any] = chunks[-1]["usage"]["prompt_tokens_details"]
        else:
            got = r.json()["usage"]["prompt_tokens_details"]
        return got

    cmpl = await details("/v1/completions")
    if stream:
        assert set(cmpl) == {"cached_tokens"}
    else:
        assert cmpl == {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
    first = await details("/v1/chat/completions")
    again = await details("/v1/chat/completions")
    want = {"cached_tokens", "created_cache_tokens"} | (set() if stream else {"multimodal_tokens"})
    assert set(first) == set(again) == want
    # the first chat writes its whole blocks to the cache; the repeat reads them instead
    assert first["created_cache_tokens"] > 0 and first["created_cache_tokens"] % 16 == 0
    assert again["cached_tokens"] == first["cached_tokens"] + first["created_cache_tokens"]
    assert again["created_cache_tokens"] == 0


async def test_x_request_id_sets_id(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        headers={"X-Request-Id": "fixture-req-1"},
        json={"prompt": "hi", "max_tokens": 2},
    )
    assert r.json()["id"] == "cmpl-fixture-req-1"
    assert "x-request-id" not in r.headers


@pytest.mark.parametrize(
    ("name", "path", "usage"),
    [
        pytest.param("completions_stream.wire.txt", "/v1/completions", False, id="cmpl"),
        pytest.param("completions_stream_usage.wire.txt", "/v1/completions", True, id="cmpl-u"),
        pytest.param("chat_stream.wire.txt", "/v1/chat/completions", False, id="chat"),
        pytest.param("chat_stream_usage.wire.txt", "/v1/chat/completions", True, id="chat-u"),
    ],
)
async def test_sse_framing_matches_wire(fleet: Fleet, name: str, path: str, usage: bool) -> None:
    rec = fixture(name.replace(".wire.txt", ".json"))
    want_head, want_chunks = dechunk((FIX / name).read_bytes())
    want = events(want_chunks)
    body = json.loads(rec["request"]["body"])
    body["ignore_eos"] = True  # same number of token events as the recording
    raw = await raw_request(fleet.engines[0].url, "POST", path, json.dumps(body).encode())
    head, chunks = dechunk(raw)
    got = events(chunks)
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    assert header_names(head) == header_names(want_head)
    assert len(got) == len(want)
    assert got[-1] == want[-1] == "[DONE]"
    for g, w in zip(got[:-1], want[:-1], strict=True):
        # the emulator runs with prompt-tokens details on (recording: off)
        if "usage" in g:
            details = g["usage"].pop("prompt_tokens_details")
            assert details.pop("cached_tokens") == 0
            assert details == ({"created_cache_tokens": 0} if "chat" in name else {})
        assert shape(g) == shape(w)
        assert list(g) == list(w)
    fp = [i for i, e in enumerate(got[:-1]) if "system_fingerprint" in e]
    assert fp == [len(got) - 2], "fingerprint only on the final event"
    if usage:
        assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 8


async def test_errors_match_fixtures(fleet: Fleet) -> None:
    url = fleet.engines[0].url
    for name in [
        "err_malformed_json.json",
        "err_max_tokens_zero.json",
        "err_negative_max_tokens.json",
        "err_priority_string.json",
        "err_temperature_wrong_type.json",
        "err_unknown_model.json",
        "err_unknown_model_chat.json",
        "err_stream_unknown_model.json",
        "err_wrong_content_type.json",
        "err_get_on_post_route.json",
        "err_unknown_route.json",
    ]:
        rec = fixture(name)
        req = rec["request"]
        headers = {k: v for k, v in req["headers"] if k.lower() == "content-type"}
        body = req["body"].encode() if req["method"] == "POST" else None
        raw = await raw_request(url, req["method"], req["path"], body, headers)
        head, _, payload = raw.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        assert status == rec["response"]["status"], name
        want_hdrs = [h for h, _ in rec["response"]["headers"]]
        assert header_names(head) == want_hdrs, name
        want = rec["response"]["body_json"]
        got = json.loads(payload)
        if "models" in str(want) or "unknown_model" in name:
            want = json.loads(json.dumps(want).replace("tiny-llama", MODEL))
        assert got == want, name


async def test_prompt_too_long_is_plain_400_even_streaming(client: httpx.AsyncClient) -> None:
    for stream in (False, True):
        r = await client.post(
            "/v1/completions",
            json={"prompt": "hello world " * 400, "max_tokens": 8, "stream": stream},
        )
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["param"] == "input_tokens" and err["type"] == "BadRequestError"
        assert "maximum context length is 512 tokens" in err["message"]


async def test_max_tokens_over_context_is_clamped(client: httpx.AsyncClient) -> None:
    """max_tokens <= max_model_len (512 here) but past the context: 200, clamped
    (fixture max_tokens_over_context_clamped.json: 8 + 2045 > 2048 gave 2040 tokens)."""
    for max_tokens in (505, 512):
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": "The prefix cache is warm.",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["total_tokens"] == 512
        assert u["completion_tokens"] == 512 - u["prompt_tokens"]
        assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_over_max_model_len_is_400(
    client: httpx.AsyncClient, path: str, stream: bool
) -> None:
    """max_tokens > max_model_len itself is refused like vLLM 0.32 (fix-list F1)."""
    body: dict[str, Any] = {"max_tokens": 513, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = await client.post(path, json=body)
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": {
            "message": "max_tokens=513 cannot be greater than max_model_len=512. "
            "Please request fewer output tokens. (parameter=max_tokens, value=513)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }


async def test_over_long_prompt_wins_over_max_tokens(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "hello world " * 400, "max_tokens": 5000}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_tokens"


async def test_tokenize_detokenize_agree(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "The prefix cache is warm."})
    got = r.json()
    assert shape(got) == shape(fixture("tokenize_prompt.json")["response"]["body_json"])
    r2 = await client.post("/detokenize", json={"tokens": got["tokens"]})
    assert r2.json() == {"prompt": "The prefix cache is warm."}
    r3 = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r3.json()["tokens"][0] == 1  # BOS, like the recorded chat template
    r4 = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "return_token_ids": True,
        },
    )
    assert r4.json()["prompt_token_ids"] == r3.json()["tokens"]


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exposed")


async def test_metrics_families_like_fixture(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
    r = await client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
    want = (FIX / "metrics_b_after_requests.prom.txt").read_text()

    def families(text: str) -> set[tuple[str, str]]:
        return {
            tuple(line.split()[2:4])
            for line in text.splitlines()  # type: ignore[misc]
            if line.startswith("# TYPE ") and " http_" not in line
        }

    assert families(r.text) == families(want)
    for line in r.text.splitlines():
        if line.startswith("vllm:") and "admission" not in line and "config_info" not in line:
            assert 'engine="0"' in line and f'model_name="{MODEL}"' in line, line
    assert re.search(r'vllm:cache_config_info\{.*block_size="16".*num_gpu_blocks="64"', r.text)
    le = re.findall(r'time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"', r.text)
    assert le == re.findall(r'time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"', want)
    assert (
        metric(r.text, "vllm:request_success_total", finished_reason="stop")
        + metric(r.text, "vllm:request_success_total", finished_reason="length")
        == 1
    )


async def test_disconnect_aborts_and_frees(fleet: Fleet) -> None:
    url = fleet.engines[0].url
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "prompt": "Disconnect test: tell a long story.",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    got = b""
    while got.count(b"data: ") < 5:
        got += await asyncio.wait_for(reader.read(4096), 5)
    async with httpx.AsyncClient(base_url=url) as c:
        during = (await c.get("/metrics")).text
        assert metric(during, "vllm:num_requests_running") == 1
        assert metric(during, "vllm:kv_cache_usage_perc") > 0
        writer.close()
        await writer.wait_closed()
        for _ in range(100):
            after = (await c.get("/metrics")).text
            if metric(after, "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.02)
        assert metric(after, "vllm:num_requests_running") == 0
        assert metric(after, "vllm:kv_cache_usage_perc") == 0
        assert metric(after, "vllm:request_success_total", finished_reason="abort") == 0
        assert metric(after, "vllm:generation_tokens_total") < 400
        assert metric(after, "vllm:e2e_request_latency_seconds_count") == 0


async def test_priority_order_through_http() -> None:
    spec = EngineSpec(kind="vllm", overrides={"queue_policy": "priority", "max_running": 1})
    async with run_fleet([spec], "127.0.0.1", 0, model=MODEL) as f:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=20) as c:

            async def send(tag: str, priority: int | None, header: int | None = None) -> None:
                body: dict[str, Any] = {
                    "prompt": f"{tag}: the the",
                    "max_tokens": 20,
                    "ignore_eos": True,
                }
                if priority is not None:
                    body["priority"] = priority
                hdrs = {"X-Vllm-Priority": str(header)} if header is not None else {}
                r = await c.post("/v1/completions", json=body, headers=hdrs)
                assert r.status_code == 200
                order.append(tag)

            first = asyncio.create_task(send("busy", 0))
            await asyncio.sleep(0.01)
            tasks = [asyncio.create_task(send("low", 10))]
            await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(send("none", None)))
            await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(send("high", 10, header=-5)))
            await asyncio.gather(first, *tasks)
    assert order == ["busy", "high", "none", "low"]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"[1,2]", id="array"),
        pytest.param(b'{"prompt": 5}', id="prompt-int"),
        pytest.param(b'{"prompt": []}', id="prompt-empty"),
        pytest.param(b'{"prompt": "x", "stop": 3}', id="stop-int"),
        pytest.param(b'{"prompt": [99999999]}', id="bad-token-id"),
        pytest.param(b'{"messages": "hi"}', id="chat-to-completions"),
        pytest.param(b'{"prompt": "x", "n": 0}', id="n0"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
    ],
)
async def test_bad_input_never_crashes(client: httpx.AsyncClient, body: bytes) -> None:
    r = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "error" in r.json()
    r = await client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    ok = await client.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("name", "path"),
    [
        pytest.param("completions_logprobs.json", "/v1/completions", id="completion"),
        pytest.param("chat_logprobs.json", "/v1/chat/completions", id="chat"),
    ],
)
async def test_logprobs_shape_like_fixture(client: httpx.AsyncClient, name: str, path: str) -> None:
    rec = fixture(name)
    body = {**json.loads(rec["request"]["body"]), "ignore_eos": True}
    got = (await client.post(path, json=body)).json()["choices"][0]["logprobs"]
    want = rec["response"]["body_json"]["choices"][0]["logprobs"]
    if "content" in got:
        assert shape(got) == shape(want)
        assert len(got["content"]) == 3 and len(got["content"][0]["top_logprobs"]) == 2
        assert got["content"][0]["top_logprobs"][0]["token"] == got["content"][0]["token"]
    else:
        assert len(got["tokens"]) == 3 and got["text_offset"][0] == 0
        assert all(lp <= 0 for lp in got["token_logprobs"])
        assert got["tokens"][0] in got["top_logprobs"][0]
        # top_logprobs keys are token strings: compare everything else by shape
        tops = got.pop("top_logprobs")
        assert [len(t) for t in tops] == [len(t) for t in want["top_logprobs"]] == [2, 2, 2]
        assert shape({k: v for k, v in want.items() if k != "top_logprobs"}) == shape(got)


async def test_continuous_usage_on_every_chunk(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "x y z",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = await client.post("/v1/completions", json=body)
    chunks = [json.loads(c[6:]) for c in r.text.split("\n\n") if c.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 4]


async def test_bad_priority_header_and_float_priority(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    r = await client.post("/v1/completions", json=body, headers={"X-Vllm-Priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = await client.post("/v1/completions", json={**body, "priority": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.priority"
    r = await client.post("/v1/completions", json=body, headers={"X-Vllm-Priority": "-3"})
    assert r.status_code == 200


async def test_missing_prompt_is_vllm_message(client: httpx.AsyncClient) -> None:
    """Fix-list F4: a completion without ``prompt`` (or with ``[]``) words it as vLLM 0.32."""
    for body in ({"max_tokens": 2}, {"max_tokens": 2, "prompt": []}):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Either prompt or prompt_embeds must be provided and non-empty. "
            "(parameter=prompt)",
            "type": "BadRequestError",
            "param": "prompt",
            "code": 400,
        }


async def test_missing_field_shows_dict_input_elided(client: httpx.AsyncClient) -> None:
    """Fix-list F5: pydantic's dict ``input`` is shown as '<dict of N items>'."""
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "Bad Request" and err["param"] == "body.messages"
    assert err["message"] == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', "
        "'msg': 'Field required', 'input': '<dict of 2 items>'}"
    )
    # a scalar input is still shown as itself
    r = await client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
    assert "'input': 'hot'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_non_streaming(client: httpx.AsyncClient, path: str) -> None:
    """Fix-list F3: ``n`` independent choices, each repeatable; choice 0 is the n=1 output;
    greedy choices are equal (as on real vLLM); usage counts every choice."""
    body: dict[str, Any] = {"max_tokens": 6, "ignore_eos": True, "n": 3}
    if path == "/v1/completions":
        body["prompt"] = "several answers"
    else:
        body["messages"] = [{"role": "user", "content": "several answers"}]

    def texts(resp: httpx.Response) -> list[str]:
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == list(range(len(choices)))
        return [c["text"] if "text" in c else c["message"]["content"] for c in choices]

    r = await client.post(path, json=body)
    sampled = texts(r)
    assert len(sampled) == 3 and len(set(sampled)) == 3, sampled
    assert r.json()["usage"]["completion_tokens"] == 18
    assert texts(await client.post(path, json=body)) == sampled, "repeatable"
    single = texts(await client.post(path, json={**body, "n": 1}))
    assert single == sampled[:1]
    greedy = texts(await client.post(path, json={**body, "temperature": 0}))
    assert len(greedy) == 3 and len(set(greedy)) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_streaming(client: httpx.AsyncClient, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 5, "ignore_eos": True, "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if path == "/v1/completions":
        body["prompt"] = "several answers"
    else:
        body["messages"] = [{"role": "user", "content": "several answers"}]
    plain = (await client.post(path, json={**body, "stream": False})).json()
    r = await client.post(path, json=body)
    assert r.status_code == 200
    raw = [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]
    assert raw[-1] == "[DONE]"
    events = [json.loads(x) for x in raw[:-1]]
    assert len({e["id"] for e in events}) == 1
    text = {0: "", 1: ""}
    finished = []
    for e in events[:-1]:
        (choice,) = e["choices"]
        delta = choice.get("delta", choice)
        text[choice["index"]] += delta.get("text") or delta.get("content") or ""
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert sorted(finished) == [0, 1]
    if path == "/v1/chat/completions":
        roles = [
            e["choices"][0]["index"] for e in events[:-1] if "role" in e["choices"][0]["delta"]
        ]
        assert roles == [0, 1]
    for i, c in enumerate(plain["choices"]):
        assert text[i] == c.get("text", c.get("message", {}).get("content")), i
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert [i for i, e in enumerate(events) if "system_fingerprint" in e] == [len(events) - 1]


async def test_n_choices_client_disconnect_frees_all(fleet: Fleet) -> None:
    """Closing an n=2 stream early aborts both generations (running back to 0)."""
    url = fleet.engines[0].url
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "n": 2, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            async for _ in r.aiter_raw():
                got += 1
                if got >= 3:
                    break
        running = -1.0
        for _ in range(100):
            running = metric((await c.get("/metrics")).text, "vllm:num_requests_running")
            if running == 0:
                break
            await asyncio.sleep(0.05)
        assert running == 0
        generated = metric((await c.get("/metrics")).text, "vllm:generation_tokens_total")
        assert generated < 100, "both choices stopped long before 400 tokens each"


def _labels(text: str, family: str) -> dict[str, str]:
    (line,) = [x for x in text.splitlines() if x.startswith(family + "{")]
    return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))


async def test_cache_config_info_labels_like_vllm() -> None:
    """Fix-list F8: the recording's 37 labels, values from the emulated config."""
    want = _labels((FIX / "metrics_a_after_start.prom.txt").read_text(), "vllm:cache_config_info")
    assert len(want) == 37
    overrides = {"num_gpu_blocks": 24, "block_size": 128, "max_model_len": 2048}
    specs = [EngineSpec(kind="vllm", overrides=overrides), EngineSpec(kind="vllm")]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as f, httpx.AsyncClient() as c:
        texts = [(await c.get(e.url + "/metrics")).text for e in f.engines]
    given, default = (_labels(t, "vllm:cache_config_info") for t in texts)
    assert set(given) == set(default) == set(want)
    # same geometry as the recorded server -> the same values, except what differs by
    # construction: the block size was given here, and the CPU build's KV memory size
    differ = {"user_specified_block_size", "kv_cache_memory_bytes"}
    assert {k: v for k, v in given.items() if k not in differ} == {
        k: v for k, v in want.items() if k not in differ
    }
    assert given["user_specified_block_size"] == "True"
    # profile geometry (test profile: 64 blocks of 16, max_model_len 512), no override
    assert default["num_gpu_blocks_override"] == "None"
    assert default["user_specified_block_size"] == "False"
    assert (default["block_size"], default["num_gpu_blocks"]) == ("16", "64")
    assert default["kv_cache_size_tokens"] == "1024"
    assert default["kv_cache_max_concurrency"] == "2.0"
