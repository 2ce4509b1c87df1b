"""The router's CPU per streamed request, spliced versus raw relay, in process.

    .venv/bin/python bench/bench_splice.py [--tree NAME=DIR ...] [--rounds 7]
        [--streams 2000] [--tokens 16] [--profile]

No network and no engine: the router's real serve loop (``ServeLoop.serve``:
admission, pick, exchange, splicer, metrics) runs over an upstream that answers
from recorded bytes of a real vLLM 0.32 server
(``shared/fixtures/vllm-0.32-cpu/``, beside the clone, as the tests find them),
and the client's ``send`` drops what it is given. Per tree it times, in
microseconds of process CPU time per stream (``--tokens`` generated tokens, one SSE event per
upstream chunk as vLLM writes them):

  splicer      a fresh ``StreamSplicer`` fed the upstream stream the router asks
               for (``return_token_ids`` + ``include_usage``), then ``finish()``
  serve-splice the serve loop on a resumable 16-token stream (the splicer path)
  serve-raw    the same request through a serve loop whose splicer is off
               (``splicer_for`` returns None, a switch of this bench only): the
               exchange relays the engine's bytes unchanged, as the router did
               for every stream before the one-request-path redesign; the
               engine's answer is then the client's stream (no token ids, no
               usage event), as vLLM writes it
  delta        serve-splice minus serve-raw of the same round: what the splicer
               path adds per stream

``--tree NAME=DIR`` (repeatable) runs each measurement with ``PYTHONPATH=DIR``
(a checkout or a ``git archive`` holding ``fleetgate/``); trees take turns
within every round (the order alternates), so drift on a shared machine hits
them alike. Medians over rounds, with the range. ``--profile`` prints a
cProfile of serve-splice and serve-raw of the first tree (own time).

``--split`` instead prints, per tree, where the splicer's time goes: the least
CPU time of 15 repeats of each step (a splicer's set-up, one plain token event
alone in a chunk and four in one chunk, the first event, the finishing event,
the usage event, ``[DONE]``, ``finish()``, the upstream body), in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO.parent / "shared" / "fixtures" / "vllm-0.32-cpu"
MODEL = "tiny-llama"
PROMPT = "The prefix cache is warm."


# ----------------------------------------------------------------- recorded streams


def _events(name: str) -> list[bytes]:
    path = FIXTURES / name
    if not path.exists():
        raise SystemExit(f"missing recording {path} (shared/fixtures beside the clone)")
    body = json.loads(path.read_text())["response"]["body"]
    return [part.encode() + b"\n\n" for part in body.split("\n\n") if part]


def _stretch(events: list[bytes], tokens: int) -> list[bytes]:
    """``events`` (first, plain..., finish) with the plain events repeated to ``tokens``."""
    first, plain, finish = events[0], events[1:-1], events[-1]
    middle = [plain[i % len(plain)] for i in range(tokens - 2)]
    return [first, *middle, finish]


def streams(tokens: int) -> tuple[list[bytes], list[bytes]]:
    """(what vLLM sends for the router's spliced request, for the raw request).

    Spliced: ``return_token_ids`` (token ids on every event, prompt ids on the first)
    and ``include_usage`` (the finishing event, then a usage event, as vLLM 0.32
    writes them). Raw: the client's own request, no ids, no usage.
    """
    ids = [e for e in _events("completions_stream_return_token_ids.json") if b"[DONE]" not in e]
    usage = [e for e in _events("completions_stream_usage.json") if b"[DONE]" not in e]
    plain = [e for e in _events("completions_stream.json") if b"[DONE]" not in e]
    done = b"data: [DONE]\n\n"
    ident = json.loads(ids[0][6:])["id"].encode()
    finish = json.loads(ids[-1][6:])
    finish.pop("system_fingerprint", None)  # with include_usage it is on the usage event
    ids[-1] = b"data: " + json.dumps(finish, separators=(",", ":")).encode() + b"\n\n"
    usage_event = usage[-1].replace(json.loads(usage[-1][6:])["id"].encode(), ident)
    spliced = [*_stretch(ids, tokens), usage_event, done]
    return spliced, [*_stretch(plain, tokens), done]


# ----------------------------------------------------------------- worker (one tree)


class _Response:
    status = 200
    headers = [(b"content-type", b"text/event-stream; charset=utf-8")]

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    def content_type(self) -> bytes:
        return self.headers[0][1]

    async def chunks(self) -> Any:
        for c in self._chunks:
            yield c

    async def read(self) -> bytes:
        return b"".join(self._chunks)

    async def aclose(self) -> None:
        return None


class _Upstream:
    """Answers every request from the recordings: the spliced or the raw stream."""

    def __init__(self, spliced: list[bytes], raw: list[bytes]) -> None:
        self.spliced, self.raw = spliced, raw
        self.bodies = 0

    async def send(self, base: str, path: str, body: bytes, headers: Any) -> _Response:
        self.bodies += 1
        return _Response(self.spliced if b'"return_token_ids"' in body else self.raw)

    async def aclose(self) -> None:
        return None


async def _drop(message: Any) -> None:
    return None


def _setup(tokens: int) -> tuple[Any, Any, Any]:
    os.environ.setdefault("FLEETGATE_TEST_MODE", "1")
    from fleetgate.router.app import build_router
    from fleetgate.router.config import parse_config
    from fleetgate.router.exchange import Exchange
    from fleetgate.router.serve import ServeLoop

    cfg = parse_config(
        {
            "test_mode": True,
            "pools": [
                {
                    "name": "default",
                    "backends": [{"engine": "vllm", "url": "http://127.0.0.1:18031"}],
                }
            ],
        }
    )
    app = build_router(cfg, start_background=False)
    s = app.state.router
    spliced, raw = streams(tokens)
    s.upstream = _Upstream(spliced, raw)
    for e in s.fleet:
        e.healthy, e.models = True, frozenset({MODEL})

    class RawRelay(ServeLoop):
        def splicer_for(self, req: Any) -> None:
            return None

    exchange = Exchange(s, cfg.engine_priority)
    loops = (
        ServeLoop(s, app.state.admission, exchange),
        RawRelay(s, app.state.admission, exchange),
    )
    return s, loops, (spliced, raw)


def _body(tokens: int) -> bytes:
    doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
           "stream": True}  # fmt: skip
    return json.dumps(doc).encode()


def _request(s: Any, body: bytes) -> Any:
    from fleetgate.router.request import ParseSettings, parse_request

    return parse_request(
        "/v1/completions",
        body,
        [],
        settings=ParseSettings(priority=s.config.classes),
        known_models=[MODEL],
        endpoints=list(s.fleet.endpoints),
        new_id=s.new_id,
        now=s.clock(),
    )


async def _serve(s: Any, loop: Any, body: bytes, n: int) -> float:
    """Seconds of ``n`` sequential serves (request parsing excluded)."""
    from fleetgate.router.errors import ClientSend

    total = 0.0
    for _ in range(n):
        req = _request(s, body)
        t0 = time.process_time()
        await loop.serve(req, ClientSend(_drop))
        total += time.process_time() - t0
    return total


def _splicer(chunks: list[bytes], n: int) -> float:
    from fleetgate.engines import get_adapter
    from fleetgate.router.priority.splice import StreamSplicer

    shapes = get_adapter("vllm").token_events
    t0 = time.process_time()
    for _ in range(n):
        sp = StreamSplicer("completions", include_usage=False, return_token_ids=False)
        sp.use_token_events(shapes)
        for c in chunks:
            sp.feed(c)
        sp.finish()
    return time.process_time() - t0


def _check(s: Any, loops: Any, tokens: int) -> None:
    """Both loops take the path they are meant to and deliver ``tokens`` tokens."""
    from fleetgate.router.errors import ClientSend

    for raw, loop in zip((False, True), loops, strict=True):
        got: list[bytes] = []

        async def keep(message: Any, got: list[bytes] = got) -> None:
            got.append(message.get("body", b""))

        req = _request(s, _body(tokens))
        asyncio.run(loop.serve(req, ClientSend(keep)))
        out = b"".join(got)
        n = sum(1 for ev in out.split(b"\n\n") if b'"text"' in ev)
        if n != tokens or not out.endswith(b"data: [DONE]\n\n") or b'"token_ids":[' in out:
            raise SystemExit(f"raw={raw}: unexpected answer ({n} token events): {out[:300]!r}")
        if (req.splicer is None) != raw:
            raise SystemExit(f"raw={raw}: splicer {req.splicer!r}")


def split(tokens: int) -> dict[str, float]:
    """Seconds per step (least of 15 repeats of CPU time), see the module docstring."""

    from fleetgate.engines import get_adapter
    from fleetgate.router.priority.continuation import upstream_body
    from fleetgate.router.priority.splice import StreamSplicer

    spliced, _ = streams(tokens)
    shapes = get_adapter("vllm").token_events

    def new() -> StreamSplicer:
        sp = StreamSplicer("completions", include_usage=False, return_token_ids=False)
        sp.use_token_events(shapes)
        return sp

    def fed(n: int) -> StreamSplicer:
        sp = new()
        for c in spliced[:n]:
            sp.feed(c)
        return sp

    def least(fn: Any, setup: Any = None, number: int = 2000) -> float:
        best = float("inf")
        for _ in range(15):
            states = [setup() for _ in range(number)] if setup else [None] * number
            t0 = time.process_time()
            for st in states:
                fn(st)
            best = min(best, time.process_time() - t0)
        return best / number

    plain, n = spliced[3], len(spliced)
    doc = json.loads(_body(tokens))
    return {
        "set-up": least(lambda _: new()),
        "plain event": least(lambda sp: sp.feed(plain), lambda: fed(1)),
        "plain event, 4 per chunk": least(lambda sp: sp.feed(plain * 4), lambda: fed(1)) / 4,
        "first event": least(lambda sp: sp.feed(spliced[0]), new),
        "finishing event": least(lambda sp: sp.feed(spliced[n - 3]), lambda: fed(n - 3)),
        "usage event": least(lambda sp: sp.feed(spliced[n - 2]), lambda: fed(n - 2)),
        "[DONE]": least(lambda sp: sp.feed(spliced[n - 1]), lambda: fed(n - 1)),
        "finish()": least(lambda sp: sp.finish(), lambda: fed(n)),
        "whole stream": least(lambda _: fed(n).finish(), number=500),
        "upstream body": least(
            lambda _: json.dumps(upstream_body(doc, return_token_ids=True)).encode()
        ),
    }


def worker(args: argparse.Namespace) -> dict[str, float]:
    s, (spliced_loop, raw_loop), (spliced, _) = _setup(args.tokens)
    _check(s, (spliced_loop, raw_loop), args.tokens)
    n = args.streams
    out: dict[str, float] = {}
    _splicer(spliced, 200)  # warm-up
    out["splicer"] = _splicer(spliced, n) / n
    runner = asyncio.new_event_loop()
    try:
        body = _body(args.tokens)
        runner.run_until_complete(_serve(s, spliced_loop, body, 200))
        runner.run_until_complete(_serve(s, raw_loop, body, 200))
        a = b = 0.0
        for half in range(2):  # raw and spliced take turns inside the measurement
            step = n // 2
            if half == 0:
                a += runner.run_until_complete(_serve(s, spliced_loop, body, step))
                b += runner.run_until_complete(_serve(s, raw_loop, body, step))
            else:
                b += runner.run_until_complete(_serve(s, raw_loop, body, step))
                a += runner.run_until_complete(_serve(s, spliced_loop, body, step))
        out["serve-splice"] = a / (2 * (n // 2))
        out["serve-raw"] = b / (2 * (n // 2))
        out["delta"] = out["serve-splice"] - out["serve-raw"]
        if args.profile:
            for name, loop in (("serve-splice", spliced_loop), ("serve-raw", raw_loop)):
                prof = cProfile.Profile()
                prof.enable()
                runner.run_until_complete(_serve(s, loop, body, n))
                prof.disable()
                print(f"\n--- cProfile {name}, {n} streams, own time ---", file=sys.stderr)
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    finally:
        runner.close()
    return out


# ----------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--streams", type=int, default=2000, help="streams per measurement")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--split", action="store_true", help="per-step costs of the splicer")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens < 3:
        parser.error("--tokens must be at least 3")
    if args.worker:
        print(json.dumps(split(args.tokens) if args.split else worker(args)))
        return 0
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(REPO)]]
    for t in trees:
        if len(t) != 2 or not (Path(t[1]) / "fleetgate").is_dir():
            parser.error(f"--tree {'='.join(t)}: want NAME=DIR with DIR/fleetgate")
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for rnd in range(args.rounds):
        order = trees if rnd % 2 == 0 else list(reversed(trees))
        for name, tree in order:
            argv = [sys.executable, __file__, "--worker", "--streams", str(args.streams),
                    "--tokens", str(args.tokens)]  # fmt: skip
            if args.split:
                argv.append("--split")
            if args.profile and rnd == 0 and name == trees[0][0]:
                argv.append("--profile")
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()),
                   "FLEETGATE_TEST_MODE": "1"}  # fmt: skip
            done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/tmp")
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            if done.stderr.strip():
                print(done.stderr, file=sys.stderr)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in results[name][-1].items())
            print(f"round {rnd} {name}: {row}", flush=True)
    if args.split:
        print(f"\nus per step, median (min-max) of {args.rounds} rounds")
        for key in results[trees[0][0]][0]:
            cells = []
            for name, _ in trees:
                vals = [r[key] * 1e6 for r in results[name]]
                cells.append(
                    f"{name} {statistics.median(vals):6.2f} ({min(vals):.2f}-{max(vals):.2f})"
                )
            print(f"{key:<26}" + "   ".join(cells))
        return 0
    print(
        f"\nus per stream ({args.tokens} tokens, {args.streams} streams per measurement), "
        f"median (min-max) of {args.rounds} rounds"
    )
    keys = ["splicer", "serve-splice", "serve-raw", "delta"]
    print(f"{'tree':<12}" + "".join(f"{k:>24}" for k in keys))
    for name, rows in results.items():
        cells = []
        for k in keys:
            vals = [r[k] * 1e6 for r in rows]
            cells.append(f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
        print(f"{name:<12}" + "".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
