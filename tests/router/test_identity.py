"""Issue 14 section 3: who may ask for what (fleetgate/router/identity.py).

Engines are ``httpx.MockTransport`` handlers that record what reaches them. We test:
* API keys: 401 without / with a wrong key (JSON, WWW-Authenticate); the key's tenant
  wins over the header; its default class applies when none is asked for; above its
  highest class 403, or lowered with ``above_max_class: lower``; credentials never
  reach an engine;
* keys rotate without a restart (the file is re-read when it changes; a broken new
  file keeps the keys in force); keys are held as digests only;
* config and keys-file errors name the field and the entry;
* trusted gateway: tenant/priority headers honoured only with the shared secret or
  from the configured source CIDRs, ignored otherwise;
* per-tenant rate and concurrency limits: 429 + Retry-After; the state is freed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.router.app import build_router
from fleetgate.router.config import ConfigError, parse_config
from fleetgate.router.identity import key_digest

A = "127.0.0.1:18001"
OK_BODY = {"id": "cmpl-1", "object": "text_completion", "model": "m",
           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip
BODY = {"model": "m", "prompt": "x", "max_tokens": 2}
KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"
CRITICAL = {"x-fleetgate-priority": "critical"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class Rig:
    def __init__(self, handler: Callable[[httpx.Request], Any] | None = None, **cfg: Any):
        self.seen: list[httpx.Request] = []

        async def route(request: httpx.Request) -> httpx.Response:
            self.seen.append(request)
            if handler is not None:
                result = handler(request)
                if asyncio.iscoroutine(result):
                    result = await result
                return result  # type: ignore[no-any-return]
            return httpx.Response(200, json=OK_BODY)

        self.app = build_router(
            router_config([("vllm", f"http://{A}")], **cfg),
            transport=httpx.MockTransport(route),
            start_background=False,
        )
        for e in self.app.state.router.fleet:
            e.healthy = True
            e.models = frozenset({"m"})

    def last_priority(self) -> Any:
        return json.loads(self.seen[-1].content).get("priority", 0)


def write(path: str, text: str) -> None:
    Path(path).write_text(text)


def keys_file(tmp_path: Path, entries: list[dict[str, Any]], name: str = "keys.yaml") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


def two_keys(tmp_path: Path) -> str:
    return keys_file(
        tmp_path,
        [
            {"key": KEY_A, "tenant": "team-a", "max_class": "critical", "name": "a"},
            {"key_sha256": key_digest(KEY_B).hex(), "tenant": "team-b",
             "max_class": "standard", "default_class": "batch"},
        ],
    )  # fmt: skip


async def test_api_keys_401_403_tenant_and_default_class(tmp_path: Path) -> None:
    rig = Rig(identity={"api_keys": {"keys_file": two_keys(tmp_path)}})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        post = url + "/v1/completions"
        for headers in ({}, bearer("sk-wrong-0123456789abcdef"), {"authorization": "Basic x"}):
            resp = await c.post(post, json=BODY, headers=headers)
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["code"] == 401
            assert resp.headers["www-authenticate"].startswith("Bearer")
        assert not rig.seen
        resp = await c.post(post, json=BODY, headers={**bearer(KEY_A), **CRITICAL})
        assert resp.status_code == 200 and rig.last_priority() == -8  # critical
        sent = {k.lower() for k in rig.seen[-1].headers}
        assert "authorization" not in sent and "x-api-key" not in sent
        resp = await c.post(post, json=BODY, headers={"x-api-key": KEY_B})
        assert resp.status_code == 200 and rig.last_priority() == 5  # its default: batch
        resp = await c.post(post, json=BODY, headers={**bearer(KEY_B), **CRITICAL})
        assert resp.status_code == 403, resp.text
        assert "standard" in resp.json()["error"]["message"]
        resp = await c.post(post, json={**BODY, "priority": "critical"}, headers=bearer(KEY_B))
        assert resp.status_code == 403
        resp = await c.post(
            post, json=BODY, headers={**bearer(KEY_B), "x-fleetgate-priority": "standard"}
        )
        assert resp.status_code == 200 and rig.last_priority() == 0
    gate = rig.app.state.gate
    assert KEY_A.encode() not in repr(gate.keys.keys).encode()  # digests only


async def test_above_max_class_lowered_when_configured(tmp_path: Path) -> None:
    ident = {"api_keys": {"keys_file": two_keys(tmp_path), "above_max_class": "lower"}}
    rig = Rig(identity=ident)
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        resp = await c.post(
            url + "/v1/completions", json=BODY, headers={**bearer(KEY_B), **CRITICAL}
        )
        assert resp.status_code == 200 and rig.last_priority() == 0  # lowered to standard


async def test_keys_rotate_without_restart(tmp_path: Path) -> None:
    path = two_keys(tmp_path)
    rig = Rig(identity={"api_keys": {"keys_file": path, "reload_s": 0.05}})
    keys = rig.app.state.gate.keys
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        post = url + "/v1/completions"
        assert (await c.post(post, json=BODY, headers=bearer(KEY_A))).status_code == 200
        new = "sk-rotated-0123456789abcdef"
        write(path, json.dumps({"keys": [
            {"key": new, "tenant": "team-a", "max_class": "critical"}]}))  # fmt: skip
        assert keys.poll()  # what the app's reload task does every reload_s
        assert (await c.post(post, json=BODY, headers=bearer(KEY_A))).status_code == 401
        assert (await c.post(post, json=BODY, headers=bearer(new))).status_code == 200
        write(path, "keys: [{key: short, tenant: t, max_class: nope}]")
        assert not keys.poll()  # a broken file: logged, the keys in force stay
        assert (await c.post(post, json=BODY, headers=bearer(new))).status_code == 200


async def test_reload_task_picks_up_a_changed_file(tmp_path: Path) -> None:
    path = two_keys(tmp_path)
    cfg = router_config([("vllm", f"http://{A}")],
                        identity={"api_keys": {"keys_file": path, "reload_s": 0.05}})  # fmt: skip
    app = build_router(cfg)
    async with serve(app):
        loads = app.state.gate.keys.loads
        write(path, json.dumps({"keys": []}))
        for _ in range(100):
            if app.state.gate.keys.loads > loads:
                break
            await asyncio.sleep(0.02)
        assert app.state.gate.keys.loads == loads + 1 and not app.state.gate.keys.keys


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        ([{"key": KEY_A, "tenant": "t", "max_class": "vip"}], "keys[0].max_class: unknown"),
        (
            [
                {"key": KEY_A, "tenant": "t", "max_class": "critical"},
                {
                    "key": KEY_B,
                    "tenant": "t",
                    "max_class": "batch",
                    "default_class": "critical",
                    "name": "etl",
                },
            ],
            "keys[1] (etl).default_class: above",
        ),  # fmt: skip
        ([{"key": "short", "tenant": "t", "max_class": "batch"}], "keys.0.key"),
        ([{"tenant": "t", "max_class": "batch"}], "exactly one of key, key_sha256"),
        (
            [
                {"key": KEY_A, "tenant": "t", "max_class": "batch"},
                {"key": KEY_A, "tenant": "u", "max_class": "batch"},
            ],
            "listed twice",
        ),  # fmt: skip
    ],
)
def test_keys_file_errors_name_the_entry(
    tmp_path: Path, entries: list[dict[str, Any]], needle: str
) -> None:
    ident = {"api_keys": {"keys_file": keys_file(tmp_path, entries)}}
    cfg = router_config([("vllm", f"http://{A}")], identity=ident)
    with pytest.raises(ConfigError, match="identity.api_keys.keys_file") as err:
        build_router(cfg)
    assert needle in str(err.value)


def test_identity_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"identity\.trusted_gateway"):
        parse_config({"identity": {"trusted_gateway": {}}})
    with pytest.raises(ConfigError, match=r"identity\.trusted_gateway\.source_cidrs"):
        parse_config({"identity": {"trusted_gateway": {"source_cidrs": ["nope"]}}})
    with pytest.raises(ConfigError, match=r"identity\.tenant_limits\.default\.requests_per_s"):
        parse_config({"identity": {"tenant_limits": {"default": {"requests_per_s": 0}}}})
    with pytest.raises(ConfigError, match=r"identity\.api_keys\.keys_fil"):
        parse_config({"identity": {"api_keys": {"keys_fil": "x"}}})


@pytest.mark.parametrize("via", ["secret", "cidr"])
async def test_trusted_gateway_headers_only_from_the_gateway(tmp_path: Path, via: str) -> None:
    secret = tmp_path / "gw"
    secret.write_text("s3cret-gateway-token\n")
    gw: dict[str, Any] = (
        {"secret_file": str(secret)} if via == "secret" else {"source_cidrs": ["127.0.0.0/8"]}
    )
    rig = Rig(identity={"trusted_gateway": gw})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        post = url + "/v1/completions"
        trusted = {"x-fleetgate-gateway-secret": "s3cret-gateway-token"} if via == "secret" else {}
        resp = await c.post(post, json=BODY, headers={**CRITICAL, **trusted})
        assert resp.status_code == 200 and rig.last_priority() == -8
        assert "x-fleetgate-gateway-secret" not in {k.lower() for k in rig.seen[-1].headers}
        if via == "secret":  # anyone else: the class header is ignored (standard)
            for wrong in ({}, {"x-fleetgate-gateway-secret": "guess"}):
                resp = await c.post(post, json=BODY, headers={**CRITICAL, **wrong})
                assert resp.status_code == 200 and rig.last_priority() == 0
            resp = await c.post(post, json={**BODY, "priority": "critical"})
            assert resp.status_code == 200 and rig.last_priority() == 0
    if via == "cidr":
        other = Rig(identity={"trusted_gateway": {"source_cidrs": ["10.0.0.0/8"]}})
        async with serve(other.app) as url, httpx.AsyncClient() as c:
            resp = await c.post(url + "/v1/completions", json=BODY, headers=CRITICAL)
            assert resp.status_code == 200 and other.last_priority() == 0


async def test_gateway_and_keys_together(tmp_path: Path) -> None:
    secret = tmp_path / "gw"
    secret.write_text("s3cret-gateway-token")
    rig = Rig(identity={"api_keys": {"keys_file": two_keys(tmp_path)},
                        "trusted_gateway": {"secret_file": str(secret)}})  # fmt: skip
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        post = url + "/v1/completions"
        assert (await c.post(post, json=BODY)).status_code == 401
        gw = {"x-fleetgate-gateway-secret": "s3cret-gateway-token", **CRITICAL}
        resp = await c.post(post, json=BODY, headers=gw)
        assert resp.status_code == 200 and rig.last_priority() == -8


async def test_tenant_rate_limit_429_with_retry_after() -> None:
    limits = {"default": {"requests_per_s": 1, "burst": 2}, "tenants": {"vip": {}}}
    rig = Rig(identity={"tenant_limits": limits})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        post = url + "/v1/completions"
        t = {"x-fleetgate-tenant": "etl"}
        got = [(await c.post(post, json=BODY, headers=t)).status_code for _ in range(3)]
        assert got == [200, 200, 429]
        resp = await c.post(post, json=BODY, headers=t)
        assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]["type"] == "RateLimitError"
        other = {"x-fleetgate-tenant": "web"}  # another tenant is not affected
        assert (await c.post(post, json=BODY, headers=other)).status_code == 200
        vip = {"x-fleetgate-tenant": "vip"}  # listed without limits: unlimited
        assert {(await c.post(post, json=BODY, headers=vip)).status_code for _ in range(5)} == {200}


async def test_tenant_concurrency_limit_and_state_is_freed() -> None:
    gate = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return httpx.Response(200, json=OK_BODY)

    rig = Rig(slow, identity={"tenant_limits": {"default": {"max_concurrent": 1}}})
    limiter = rig.app.state.limiter
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        post = url + "/v1/completions"
        first = asyncio.ensure_future(c.post(post, json=BODY))
        for _ in range(200):
            if rig.seen:
                break
            await asyncio.sleep(0.01)
        resp = await c.post(post, json=BODY)
        assert resp.status_code == 429 and "retry-after" in resp.headers
        gate.set()
        assert (await first).status_code == 200
        for i in range(50):  # distinct tenants, one request each: nothing stays behind
            r = await c.post(post, json=BODY, headers={"x-fleetgate-tenant": f"t{i}"})
            assert r.status_code == 200
    assert limiter.state == {}


def test_rate_limiter_state_is_bounded_for_many_tenants() -> None:
    from fleetgate.router.config import TenantLimit
    from fleetgate.router.identity import TenantLimiter

    lim = TenantLimiter(TenantLimit(requests_per_s=10, burst=5), {})
    now = 0.0
    for i in range(20_000):
        lim.acquire(f"tenant-{i}", now)
        lim.release(f"tenant-{i}", now)
        now += 0.01
    assert len(lim.state) <= 2048
    t0 = time.monotonic()
    lim.sweep(now + 10)
    assert lim.state == {} and time.monotonic() - t0 < 1
