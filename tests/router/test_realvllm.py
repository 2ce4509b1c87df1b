"""The router in front of TWO real vLLM 0.32 (CPU) servers (tests/realvllm.py recipe).

We test these aspects:
* streaming passthrough through the router is identical in content to a direct call
  (same text, same usage), for completions and chat;
* repeated prompts sharing a long prefix (well over the 128-token CPU block) land on
  one engine, and THAT engine's own ``vllm:prefix_cache_hits_total`` shows the hits,
  as does ``usage.prompt_tokens_details.cached_tokens`` (the router's closed loop).

Never skipped: if vLLM cannot be installed or started, the fixture fails the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from realvllm import RealVllm, RealVllmError, ensure_model, ensure_venv, run_real_vllm
from routerkit import router_config, serve

from fleetgate.router.app import build_router

pytestmark = [pytest.mark.realvllm, pytest.mark.slow, pytest.mark.timeout(900)]

# ~200 "alphaN beta" pairs: about 630 tokens with the tiny model's tokenizer (the fixtures
# measured 377 tokens for 120 pairs), i.e. four whole 128-token CPU blocks and more.
PREFIX = " ".join(f"alpha{i} beta" for i in range(200)) + "."


@pytest.fixture(scope="module")
def two_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RealVllm]]:
    try:
        python = ensure_venv()
        model = ensure_model(python)
    except RealVllmError as e:
        pytest.fail(f"real vLLM unavailable (a failure, not a skip): {e}", pytrace=False)
    logs = tmp_path_factory.mktemp("router-real-vllm")
    with contextlib.ExitStack() as stack:
        try:
            servers = [
                stack.enter_context(run_real_vllm(python, model, logs / f"server{i}.log"))
                for i in range(2)
            ]
        except RealVllmError as e:
            pytest.fail(str(e), pytrace=False)
        yield servers


def texts(body: bytes) -> list[str]:
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                out.append(piece or "")
    return out


def usage(body: bytes) -> dict[str, Any]:
    """The ``usage`` of the final usage chunk, without the per-run prompt-cache details."""
    for line in body.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            found = json.loads(line[6:]).get("usage")
            if found:
                return {k: v for k, v in found.items() if k != "prompt_tokens_details"}
    raise AssertionError("no usage chunk")


def counter(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


async def hits(c: httpx.AsyncClient, base: str) -> float:
    """The engine's own prefix-cache hit counter (tokens)."""
    return counter((await c.get(base + "/metrics")).text, "vllm:prefix_cache_hits_total")


def app_for(servers: list[RealVllm]) -> Any:
    backends = [("vllm", s.base_url) for s in servers]
    # capacity 4 = the servers' --max-num-seqs
    return build_router(router_config(backends, capacity=4, scrape={"timeout_s": 5.0}))


async def test_streaming_passthrough_identical_to_direct(two_vllm: list[RealVllm]) -> None:
    model = two_vllm[0].model
    async with serve(app_for(two_vllm)) as url, httpx.AsyncClient(timeout=120) as c:
        for path, extra in [
            ("/v1/completions", {"prompt": "The router forwards every byte"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}]}),
        ]:
            body = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip
            via = await c.post(url + path, json=body)
            assert via.status_code == 200, via.text
            served_by = via.headers["x-fleetgate-endpoint"]
            direct_url = next(s.base_url for s in two_vllm if s.base_url.endswith(served_by))
            direct = await c.post(direct_url + path, json=body)
            # Same content. Event boundaries are vLLM's timing (its output collector merges
            # deltas a slow reader has not taken yet), so compare the text, not the events.
            assert "".join(texts(via.content)) == "".join(texts(direct.content))
            assert usage(via.content) == usage(direct.content)
            assert usage(via.content)["completion_tokens"] == 24
            assert via.content.endswith(b"data: [DONE]\n\n")


async def test_shared_long_prefix_sticks_and_engine_counts_hits(two_vllm: list[RealVllm]) -> None:
    model = two_vllm[0].model
    async with serve(app_for(two_vllm)) as url, httpx.AsyncClient(timeout=120) as c:
        before = {s.base_url: await hits(c, s.base_url) for s in two_vllm}
        used, cached = [], []
        for q in range(5):
            body = {"model": model, "prompt": f"{PREFIX} Question {q}: what is gamma?",
                    "max_tokens": 4, "temperature": 0}  # fmt: skip
            resp = await c.post(url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            used.append(resp.headers["x-fleetgate-endpoint"])
            cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert len(set(used)) == 1, used
        assert cached[0] == 0 and all(c >= 4 * 128 for c in cached[1:]), cached
        after = {s.base_url: await hits(c, s.base_url) for s in two_vllm}
        target = next(s.base_url for s in two_vllm if s.base_url.endswith(used[0]))
        other = next(s.base_url for s in two_vllm if s.base_url != target)
        assert after[target] - before[target] >= 4 * 4 * 128  # its own counter shows the hits
        assert after[other] == before[other]
        text = (await c.get(url + "/metrics")).text
        assert counter(text, "fleetgate_actual_cached_tokens_total") >= 4 * 4 * 128
        assert counter(text, "fleetgate_predicted_cached_tokens_total") > 0
        # The router exports the engine's own counter as scraped: it catches up within scrapes.
        for _ in range(50):
            text = (await c.get(url + "/metrics")).text
            if counter(text, "fleetgate_engine_prefix_cache_hit_tokens") >= after[target]:
                break
            await asyncio.sleep(0.2)
        assert counter(text, "fleetgate_engine_prefix_cache_hit_tokens") >= after[target]
