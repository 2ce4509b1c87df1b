"""Wire-level helpers for the conformance suite (no fleetgate imports).

* :func:`raw_request` speaks HTTP/1.1 over a plain asyncio socket, so the checks
  see what the fixtures recorded: the status line, the headers and each
  chunked-transfer chunk as sent (httpx would re-chunk the body). It connects
  only to 127.0.0.0/8.
* :func:`scrape` parses a ``/metrics`` exposition with prometheus_client's
  parser into families and a flat sample map.
* :func:`poll` re-scrapes until a predicate holds or a deadline passes. Real
  vLLM's gauges lag and its ``/metrics`` can stall for a second under load
  (fixture README quirk 9), so no check trusts one sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class RawResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    chunks: tuple[bytes, ...] | None
    """Chunk payloads of a chunked body, in order; None for content-length bodies."""

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)


def _host_port(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    host, port = parts.hostname or "", parts.port or 80
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"conformance traffic must stay on loopback, got {base_url}")
    return host, port


class RawStream:
    """One HTTP/1.1 exchange over its own TCP connection (closed by :meth:`close`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    async def open(
        cls, base_url: str, method: str, path: str, body: bytes | None = None, **kw: str
    ) -> RawStream:
        stream = await cls.send(base_url, method, path, body, **kw)
        await stream._read_head()
        return stream

    @classmethod
    async def send(
        cls, base_url: str, method: str, path: str, body: bytes | None = None, **kw: str
    ) -> RawStream:
        """Send the request without reading anything back (a client about to hang up)."""
        host, port = _host_port(base_url)
        reader, writer = await asyncio.open_connection(host, port)
        head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: */*"]
        if body is not None:
            head.append(f"Content-Type: {kw.get('content_type', 'application/json')}")
            head.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        return cls(reader, writer)

    async def _read_head(self) -> None:
        status_line = (await self.reader.readline()).decode("latin-1").rstrip("\r\n")
        self.status = int(status_line.split(" ", 2)[1])
        headers = []
        while True:
            line = (await self.reader.readline()).decode("latin-1").rstrip("\r\n")
            if not line:
                break
            k, _, v = line.partition(":")
            headers.append((k.strip().lower(), v.strip()))
        self.headers = tuple(headers)

    def header(self, name: str) -> str | None:
        return dict(self.headers).get(name.lower())

    async def next_chunk(self) -> bytes | None:
        """The next chunked-transfer payload, or None at the terminating 0-chunk."""
        size_line = await self.reader.readline()
        if not size_line:
            raise ConnectionError("connection closed inside a chunked body")
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            await self.reader.readline()  # the CRLF after the (empty) trailer
            return None
        data = await self.reader.readexactly(size)
        crlf = await self.reader.readexactly(2)
        if crlf != b"\r\n":
            raise ValueError(f"chunk not followed by CRLF: {crlf!r}")
        return data

    async def read_all(self) -> RawResponse:
        chunks: list[bytes] | None = None
        if (self.header("transfer-encoding") or "").lower() == "chunked":
            chunks = []
            while (chunk := await self.next_chunk()) is not None:
                chunks.append(chunk)
            body = b"".join(chunks)
        else:
            length = int(self.header("content-length") or "0")
            body = await self.reader.readexactly(length)
        return RawResponse(
            self.status, self.headers, body, None if chunks is None else tuple(chunks)
        )

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def raw_request(
    base_url: str, method: str, path: str, body: bytes | None = None, **kw: str
) -> RawResponse:
    stream = await RawStream.open(base_url, method, path, body, **kw)
    try:
        return await asyncio.wait_for(stream.read_all(), timeout=120)
    finally:
        await stream.close()


def sse_events(body: bytes) -> list[str]:
    """Split an SSE body into the payloads of its ``data:`` events (strict framing)."""
    text = body.decode()
    if not text.endswith("\n\n"):
        raise ValueError(f"SSE body does not end with a blank line: {text[-40:]!r}")
    events = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        if len(lines) != 1 or not lines[0].startswith("data: "):
            raise ValueError(f"SSE event is not one 'data: ' line: {block[:120]!r}")
        events.append(lines[0][len("data: ") :])
    return events


@dataclasses.dataclass(frozen=True)
class Scrape:
    content_type: str
    families: Mapping[str, str]
    """family name -> type (gauge, counter, histogram, info, ...)."""
    samples: Mapping[tuple[str, Labels], float]
    elapsed_s: float

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        if not found:
            raise KeyError(f"no sample {name}{labels or ''} in /metrics")
        return sum(found)

    def labelsets(self, name: str) -> list[dict[str, str]]:
        return [dict(ls) for (n, ls) in self.samples if n == name]


async def scrape(client: httpx.AsyncClient, base_url: str) -> Scrape:
    started = time.monotonic()
    resp = await client.get(f"{base_url}/metrics", timeout=30.0)
    resp.raise_for_status()
    families: dict[str, str] = {}
    samples: dict[tuple[str, Labels], float] = {}
    for fam in text_string_to_metric_families(resp.text):
        families[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(
        resp.headers.get("content-type", ""), families, samples, time.monotonic() - started
    )


async def poll(
    client: httpx.AsyncClient,
    base_url: str,
    predicate: Callable[[Scrape], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "condition",
) -> Scrape:
    """Scrape until ``predicate`` holds; AssertionError with the last sample if it never does."""
    started = time.monotonic()
    deadline = started + timeout_s
    trace: list[str] = []
    while True:
        last = await scrape(client, base_url)
        if predicate(last):
            return last
        trace.append(f"{time.monotonic() - started:.2f}s:{_gauges(last)}")
        if time.monotonic() > deadline:
            if len(trace) > 40:
                trace = [*trace[:20], "...", *trace[-20:]]
            print(f"poll trace for {what}: " + " ".join(trace))
            raise AssertionError(
                f"{what} not seen within {timeout_s}s; last scrape: {_brief(last)}"
            )
        await asyncio.sleep(interval_s)


def _gauges(s: Scrape) -> str:
    """running/waiting/KV usage and the scrape's duration, e.g. ``r4w2kv0.52(0.03)``."""
    try:
        r, w = s.value("vllm:num_requests_running"), s.value("vllm:num_requests_waiting")
    except KeyError:
        return "?"
    kv = s.samples.get(("vllm:kv_cache_usage_perc", _labels_of(s, "vllm:kv_cache_usage_perc")), -1)
    return f"r{r:g}w{w:g}kv{kv:.2f}({s.elapsed_s:.2f})"


def _labels_of(s: Scrape, name: str) -> Labels:
    return next((ls for (n, ls) in s.samples if n == name), frozenset())


def _brief(s: Scrape) -> str:
    keys = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    )
    out = {}
    for k in keys:
        try:
            out[k] = s.value(k)
        except KeyError:
            out[k] = float("nan")
    return json.dumps(out)
