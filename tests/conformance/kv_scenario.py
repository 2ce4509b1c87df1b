"""The KV-cache-events scenario, its recorder and its checks (real vLLM and emulator).

One scenario, run against a server whose ``--kv-events-config`` binds its PUB socket
on an ``ipc://`` path (vLLM 0.32 binds ipc/inproc endpoints and those with ``*`` or
``::``, and *connects* to any other, ``ZmqEventPublisher._is_bind_endpoint``; a PUB
that connects to a bound SUB never delivered a message on this machine, pyzmq 27.3 /
libzmq 4.3.5, tcp and ipc alike, so the tests let the engine bind, as it does in a
pod with ``tcp://*:5557``) and binds its ROUTER replay socket on another ``ipc://``
path beside it (:func:`replay_endpoint_beside`); this process's SUB and DEALER connect:

1. ``A`` = shared prefix (300 tokens) + 40 own tokens, then ``B`` = the same prefix
   + 40 other tokens (token-id prompts, so both backends see the same ids);
2. four unrelated 1,000-token prompts, one after another: 4 x 8 blocks > the 23
   usable blocks of a 24-block pool, so the idle prefix blocks are evicted;
3. ``B`` again (its prefix is stored again, from no parent);
4. ``POST /reset_prefix_cache`` (vLLM needs ``VLLM_SERVER_DEV_MODE=1``), then a
   10-token request: the reset's event goes out with the next engine step;
5. a replay request from sequence 0 on the replay socket.

The recording is a list of ``{"channel": "pub"|"replay", "step": name, "frames":
[base64, ...]}``, kept as JSON lines; :func:`check_stream` is the one set of
expectations both backends must meet.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import zmq

from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from fleetgate.engines.vllm import ADAPTER as VLLM

BLOCK_SIZE = 128
TOPIC = "kv-events"
PREFIX = [10 + (i * 7) % 1900 for i in range(300)]
PROMPT_A = PREFIX + [1000 + i for i in range(40)]
PROMPT_B = PREFIX + [1100 + i for i in range(40)]
FLOODS = [[20 + (k * 331 + i * 13) % 1950 for i in range(1000)] for k in range(4)]
FLUSH = [1500 + i for i in range(10)]
QUIET_S = 1.0
"""A step is over when no message arrived for this long."""
STEP_TIMEOUT_S = 60.0

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-kv-events.jsonl"


def replay_endpoint_beside(pub_endpoint: str) -> str:
    """An ipc:// replay endpoint in the PUB endpoint's directory. Not a TCP port: a
    port picked free before a real vLLM starts was taken by another socket in the ~30 s
    the engine takes to bind it (CI of d08de45: ``Address already in use``)."""
    return pub_endpoint.rsplit("/", 1)[0] + "/replay.ipc"


def kv_events_config(pub_endpoint: str, replay_endpoint: str) -> str:
    """The ``--kv-events-config`` JSON both backends are started with."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": pub_endpoint,
            "replay_endpoint": replay_endpoint,
            "topic": TOPIC,
        }
    )


def _drain(sub: zmq.Socket[bytes], step: str, out: list[dict[str, Any]], want: int = 1) -> None:
    """Collect messages until ``want`` arrived and then QUIET_S passes without one."""
    got = 0
    deadline = time.monotonic() + STEP_TIMEOUT_S
    last = time.monotonic()
    while time.monotonic() < deadline:
        if sub.poll(100):
            frames = sub.recv_multipart()
            out.append({"channel": "pub", "step": step, "frames": _b64(frames)})
            got += 1
            last = time.monotonic()
        elif got >= want and time.monotonic() - last > QUIET_S:
            return
    raise AssertionError(f"step {step}: {got} messages, wanted >= {want} (timeout)")


def _b64(frames: Sequence[bytes]) -> list[str]:
    return [base64.b64encode(f).decode() for f in frames]


_MONITORS: dict[int, Any] = {}


def watch_connection(sub: zmq.Socket[bytes]) -> None:
    """Before ``sub.connect``: watch for the connection, so ``record`` can wait for it."""
    _MONITORS[id(sub)] = sub.get_monitor_socket(zmq.EVENT_CONNECTED)


def wait_connected(sub: zmq.Socket[bytes], timeout_s: float = 60.0) -> None:
    """Block until ``sub`` is connected to the publisher, then a moment more.

    ZeroMQ drops what a PUB socket sends before a subscriber's connection and its
    subscription reached it (the "slow joiner"). The engine binds its endpoint only
    when it starts, so on a loaded machine the first request's events could be
    published before the SUB socket's reconnect found it.
    """
    monitor = _MONITORS.pop(id(sub), None)
    if monitor is None:
        return
    try:
        if not monitor.poll(int(timeout_s * 1000)):
            raise AssertionError(f"the SUB socket never connected within {timeout_s} s")
        monitor.recv_multipart()
        time.sleep(0.5)  # the subscription travels to the publisher after the connection
    finally:
        sub.disable_monitor()
        monitor.close()


def record(
    base_url: str,
    model: str,
    sub: zmq.Socket[bytes],
    replay_endpoint: str,
    out: list[dict[str, Any]],
) -> None:
    """Run the scenario; append every message received to ``out``, in order (so a
    failed run still leaves what it saw)."""
    wait_connected(sub)
    with httpx.Client(base_url=base_url, timeout=120.0) as http:

        def complete(prompt: list[int]) -> None:
            r = http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
            )
            assert r.status_code == 200, r.text

        complete(PROMPT_A)
        _drain(sub, "A", out)
        complete(PROMPT_B)
        _drain(sub, "B", out, want=0)
        for k, flood in enumerate(FLOODS):
            complete(flood)
            _drain(sub, f"flood{k}", out)
        complete(PROMPT_B)
        _drain(sub, "B-again", out)
        r = http.post("/reset_prefix_cache")
        out.append({"channel": "http", "step": "reset", "status": r.status_code, "body": r.text})
        # vLLM publishes a step's events in update_from_output: the AllBlocksCleared
        # of a reset goes out with the next engine step, so make one (no full block).
        complete(FLUSH)
        _drain(sub, "reset", out)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            if not dealer.poll(200):
                continue
            frames = dealer.recv_multipart()
            out.append({"channel": "replay", "step": "replay", "frames": _b64(frames)})
            if frames[-2:-1] == [(-1).to_bytes(8, "big", signed=True)]:
                break
        else:
            raise AssertionError("replay: no end-of-sequence marker")
    finally:
        dealer.close()


def save(recording: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in recording))


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def frames_of(message: dict[str, Any]) -> list[bytes]:
    frames = [base64.b64decode(f) for f in message["frames"]]
    # A DEALER receives the ROUTER's (b"", topic, seq, payload): drop the delimiter.
    if message["channel"] == "replay" and frames and frames[0] == b"":
        frames = frames[1:]
    return frames


def decode(recording: list[dict[str, Any]]) -> dict[str, list[KvEventBatch]]:
    """Batches per step (the replay's end marker decodes to nothing)."""
    steps: dict[str, list[KvEventBatch]] = {}
    for m in recording:
        if m["channel"] == "http":
            continue
        steps.setdefault(m["step"], []).extend(VLLM.decode_kv_events(frames_of(m)))
    return steps


def _events(batches: Sequence[KvEventBatch], kind: type) -> list[Any]:
    return [e for b in batches for e in b.events if isinstance(e, kind)]


def check_stream(recording: list[dict[str, Any]], log: Callable[[str], None] = print) -> None:
    """The expectations every backend's stream must meet."""
    steps = decode(recording)
    pub = [b for m, bs in _pairs(recording) if m == "pub" for b in bs]
    # Framing: topic, then 8-byte big-endian sequence numbers 0, 1, 2, ... without gaps.
    for m in recording:
        if m["channel"] == "pub":
            topic, seq, _payload = frames_of(m)
            assert topic == TOPIC.encode()
            assert len(seq) == 8
    seqs = [b.seq for b in pub]
    assert seqs == list(range(len(seqs))), seqs
    for b in pub:
        assert b.ts is not None and b.ts > 1.6e9
        assert b.data_parallel_rank == 0
        assert b.events, "an empty batch was published"

    # A: the two full prefix blocks + the full third block? No: 340 tokens = 2 full blocks.
    a_stored = _events(steps["A"], BlockStored)
    assert [len(s.block_hashes) for s in a_stored] == [2], a_stored
    first = a_stored[0]
    assert first.parent_hash is None
    assert first.block_size == BLOCK_SIZE
    assert list(first.token_ids) == PROMPT_A[: 2 * BLOCK_SIZE]
    assert first.medium == "GPU"
    assert all(isinstance(h, int) for h in first.block_hashes)
    # B shares both full blocks: nothing new is stored (its third block is partial).
    assert _events(steps.get("B", []), BlockStored) == []

    # Floods: each stores its 7 full blocks (1000 tokens + 1 generated), from no parent.
    for k in range(len(FLOODS)):
        st = _events(steps[f"flood{k}"], BlockStored)
        assert sum(len(s.block_hashes) for s in st) == 7, st
        assert st[0].parent_hash is None
        assert list(st[0].token_ids) == FLOODS[k][: len(st[0].token_ids)]
        for s in st:
            assert len(s.token_ids) == len(s.block_hashes) * BLOCK_SIZE
    removed = [h for k in range(len(FLOODS)) for r in _events(steps[f"flood{k}"], BlockRemoved)
               for h in r.block_hashes]  # fmt: skip
    assert removed, "no BlockRemoved although the floods overflow the pool"
    assert set(first.block_hashes) <= set(removed), "the idle prefix blocks were not evicted"
    # Every removal names a block stored earlier.
    stored_before: set[int | bytes] = set()
    for b in pub:
        for e in b.events:
            if isinstance(e, BlockStored):
                stored_before.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= stored_before, e

    # B again: its prefix is stored again under the same hashes (content-addressed).
    again = _events(steps["B-again"], BlockStored)
    assert again and again[0].parent_hash is None
    assert list(again[0].block_hashes[:2]) == list(first.block_hashes)

    # Reset: accepted, and one AllBlocksCleared (published with the next step).
    (reset,) = [m for m in recording if m["channel"] == "http"]
    assert (reset["status"], json.loads(reset["body"])) == (200, {"success": True}), reset
    assert len(_events(steps["reset"], AllBlocksCleared)) == 1

    # Replay from 0 returns the same batches as the live stream (same seqs, same events).
    replay = steps["replay"]
    assert [b.seq for b in replay] == seqs
    assert [b.events for b in replay] == [b.events for b in pub]
    log(
        f"kv events: {len(pub)} batches, "
        f"{sum(len(s.block_hashes) for s in _events(pub, BlockStored))} blocks stored, "
        f"{len(removed)} removed, replay {len(replay)} batches"
    )


def _pairs(recording: list[dict[str, Any]]) -> list[tuple[str, list[KvEventBatch]]]:
    return [
        (m["channel"], VLLM.decode_kv_events(frames_of(m)))
        for m in recording
        if m["channel"] != "http"
    ]
