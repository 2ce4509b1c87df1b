"""Router overhead, side by side, against ONE emulated vLLM engine on this machine.

    .venv/bin/python bench/bench_router_overhead.py [--requests 400] [--concurrency 16]
        [--duration-s 5] [--stream-requests 200] [--rounds 2] [--skip-peers] [--profile]
        [--compare-relay] [--tree NAME=DIR ...]

Targets (all bound to 127.0.0.1, all proxying the same engine):
  direct         the emulated engine itself (``fleetgate sim --vllm 1 --time-scale 0``)
  fleetgate      ``fleetgate router --backend vllm=URL`` (uvloop + httptools)
  vllm-router    0.1.17 from PyPI (hack/install-peers.sh), default policy
  sglang-router  0.3.2 from PyPI, ``python -m sglang_router.launch_router``, default policy
  fg-asyncio     (``--compare-loops``) fleetgate on the plain asyncio loop instead of uvloop
  fg-relay       (``--compare-relay``) fleetgate with its splicer switched off in this
                 bench only (``ServeLoop.splicer_for`` patched to None at start-up):
                 every stream is relayed raw, as before the one-request-path redesign,
                 and cannot be resumed. The spliced stream's extra cost is
                 fleetgate's figures minus fg-relay's, from the same run
  fg-NAME        (``--tree NAME=DIR``) fleetgate run from another source tree
                 (``PYTHONPATH=DIR``, e.g. a ``git archive`` of an older commit), so
                 old and new code are measured in one run

Figures per target: p50/p99 latency of 1-token non-streaming completions at
concurrency 1 and the latency ADDED over direct; requests/s at ``--concurrency``
keep-alive connections for ``--duration-s`` (bounded by a request cap); TTFT
p50/p99 of 16-token streams and the TTFT added over direct; the target
process's CPU (utime + stime from /proc, 10 ms ticks) per 1-token request and
per 16-token stream during those sequential phases: everything the process did
meanwhile, its background scrapes and probes included (for direct: the
engine's own CPU). Then the ratios the
issue asks for: fleetgate added p50 / vllm-router added p50 (target <= 1.5) and
fleetgate req/s / vllm-router req/s (target >= 0.6). ``--profile`` reruns the
fleetgate throughput phase under cProfile and prints where its time goes.

Before/after a change: ``PYTHONPATH=/tmp/old`` (a ``git archive`` of the older
commit's ``fleetgate/``) runs the engine and fleetgate from that copy; run the
two back to back, alternating, since figures drift by tens of percent.

The client is a minimal raw-asyncio HTTP/1.1 keep-alive client (no httpx), so
that client overhead stays well below the routers'. Everything shares 2 cores:
the client, the engine and the router compete, so req/s is a property of the
whole loop on this machine, not of a router alone. Rounds alternate targets to
spread drift; medians over rounds are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate")) / "peers"
HOST = "127.0.0.1"
MODEL = "m"


#: The engine runs under uvloop: ``fleetgate sim`` binds its sockets with proto 0, so
#: under the plain asyncio loop its accepted sockets keep Nagle on and every keep-alive
#: response waits ~40 ms for the client's delayed ACK (measured: 48 ms vs 0.5-2 ms).
ENGINE_UNDER_UVLOOP = (
    "import sys, uvloop; uvloop.install(); from fleetgate.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


#: fleetgate with the splicer off (``--compare-relay``): a bench-only switch, no config key.
ROUTER_WITHOUT_SPLICER = (
    "import sys, fleetgate.router.serve as serve; "
    "serve.ServeLoop.splicer_for = lambda self, req: None; "
    "from fleetgate.cli import main; sys.exit(main(sys.argv[1:]))"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------- raw client


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection(HOST, port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()

    async def post(self, port: int, path: str, body: bytes) -> tuple[int, float, bytes]:
        """(status, seconds to the first body byte that carries an SSE event or JSON, body)."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower()] = v.strip()
        first = 0.0
        if b"content-length" in headers:
            data = await self.reader.readexactly(int(headers[b"content-length"]))
            first = time.perf_counter() - t0
        else:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                chunk = (await self.reader.readexactly(size + 2))[:-2]
                if not first and b"data:" in chunk:
                    first = time.perf_counter() - t0
                parts.append(chunk)
            data = b"".join(parts)
        if headers.get(b"connection", b"").lower() == b"close":
            raise ConnectionResetError("server closed the connection")
        return status, first, data


ONE_TOKEN = json.dumps({"model": MODEL, "prompt": "Say hi", "max_tokens": 1}).encode()
STREAM_16 = json.dumps(
    {"model": MODEL, "prompt": "Count to sixteen", "max_tokens": 16, "ignore_eos": True,
     "stream": True}
).encode()  # fmt: skip


async def latency(port: int, n: int, body: bytes, want_first: bool) -> list[float]:
    conn = await Conn.open(port)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            status, first, data = await conn.post(port, "/v1/completions", body)
            if status != 200:
                raise RuntimeError(f"port {port}: HTTP {status}: {data[:200]!r}")
            out.append(first if want_first else time.perf_counter() - t0)
    finally:
        await conn.close()
    return out


async def throughput(port: int, concurrency: int, duration: float, cap: int) -> float:
    done = 0
    errors = 0
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        conn = await Conn.open(port)
        try:
            while time.perf_counter() < deadline and done < cap:
                status, _, _ = await conn.post(port, "/v1/completions", ONE_TOKEN)
                if status == 200:
                    done += 1
                else:
                    errors += 1
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if errors:
        print(f"  port {port}: {errors} non-200 answers during the throughput phase")
    return done / elapsed


# ----------------------------------------------------------------- processes


class Proc:
    def __init__(
        self, name: str, argv: list[str], port: int, log: Path, pythonpath: str | None = None
    ) -> None:
        self.name, self.port, self.log = name, port, log
        self.handle = open(log, "wb")
        env = {**os.environ, "FLEETGATE_TEST_MODE": "1", "RUST_LOG": "warn"}
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        self.proc = subprocess.Popen(
            argv, stdout=self.handle, stderr=subprocess.STDOUT, env=env, cwd="/tmp",
            start_new_session=True,
        )  # fmt: skip

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.handle.close()

    async def ready(self, within_s: float = 90.0) -> None:
        deadline = time.monotonic() + within_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-1500:]}")
            try:
                conn = await Conn.open(self.port)
                try:
                    status, _, data = await conn.post(self.port, "/v1/completions", ONE_TOKEN)
                finally:
                    await conn.close()
                if status == 200:
                    return
                last = f"HTTP {status} {data[:200]!r}"
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                last = repr(e)
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {within_s}s: {last}")


def start_targets(
    tmp: Path,
    engine: str,
    skip_peers: bool,
    profile: Path | None,
    compare_loops: bool = False,
    fg_config: str | None = None,
    compare_relay: bool = False,
    trees: Sequence[tuple[str, str]] = (),
) -> list[Proc]:
    py = sys.executable
    procs = []
    port = free_port()
    fg = [py, "-m", "fleetgate", "router", "--port", str(port), "--backend", f"vllm={engine}"]
    if fg_config:
        fg += ["--config", fg_config]
    if profile is not None:
        fg = [py, "-m", "cProfile", "-o", str(profile), *fg[1:]]
    procs.append(Proc("fleetgate", fg, port, tmp / "fleetgate.log"))
    if compare_loops:
        port = free_port()
        argv = [py, "-m", "fleetgate", "router", "--port", str(port), "--backend",
                f"vllm={engine}", "--loop", "asyncio"]  # fmt: skip
        procs.append(Proc("fg-asyncio", argv, port, tmp / "fleetgate-asyncio.log"))
    if compare_relay:
        port = free_port()
        argv = [py, "-c", ROUTER_WITHOUT_SPLICER, "router", "--port", str(port), "--backend",
                f"vllm={engine}"]  # fmt: skip
        if fg_config:
            argv += ["--config", fg_config]
        procs.append(Proc("fg-relay", argv, port, tmp / "fleetgate-relay.log"))
    for name, tree in trees:
        port = free_port()
        argv = [py, "-m", "fleetgate", "router", "--port", str(port), "--backend",
                f"vllm={engine}"]  # fmt: skip
        if fg_config:
            argv += ["--config", fg_config]
        log = tmp / f"fleetgate-{name}.log"
        procs.append(Proc(f"fg-{name}", argv, port, log, str(Path(tree).resolve())))
    if skip_peers:
        return procs
    vr = PEERS / "vllm-router-0.1.17" / "bin" / "vllm-router"
    if vr.exists():
        port = free_port()
        argv = [str(vr), "--host", HOST, "--port", str(port), "--worker-urls", engine,
                "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                "--log-level", "warning"]  # fmt: skip
        procs.append(Proc("vllm-router", argv, port, tmp / "vllm-router.log"))
    else:
        print(f"vllm-router: not installed at {vr} (run hack/install-peers.sh)")
    sg = PEERS / "sglang-router-0.3.2" / "bin" / "python"
    if sg.exists():
        port = free_port()
        argv = [str(sg), "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
                "--worker-urls", engine, "--prometheus-host", HOST,
                "--prometheus-port", str(free_port()), "--log-level", "warn"]  # fmt: skip
        procs.append(Proc("sglang-router", argv, port, tmp / "sglang-router.log"))
    else:
        print(f"sglang-router: not installed at {sg} (run hack/install-peers.sh)")
    return procs


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main_async(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="fg-bench-router-"))
    engine_port = free_port()
    sim = Proc(
        "engine",
        [sys.executable, "-c", ENGINE_UNDER_UVLOOP, "sim", "--vllm", "1",
         "--port", str(engine_port), "--host", HOST, "--time-scale", "0", "--model", MODEL,
         "--max-num-seqs", "256", "--num-gpu-blocks", "100000", "--max-model-len", "4096"],
        engine_port, tmp / "engine.log",
    )  # fmt: skip
    engine = f"http://{HOST}:{engine_port}"
    targets: list[Proc] = []
    try:
        await sim.ready()
        trees = []
        for spec in args.tree:
            name, _, tree = spec.partition("=")
            if not name or not (Path(tree) / "fleetgate").is_dir():
                raise SystemExit(f"--tree {spec}: want NAME=DIR with DIR/fleetgate")
            trees.append((name, tree))
        targets = start_targets(
            tmp, engine, args.skip_peers, None, args.compare_loops, args.fleetgate_config,
            args.compare_relay, trees,
        )  # fmt: skip
        usable = [sim]
        for t in targets:
            try:
                await t.ready()
                usable.append(t)
            except RuntimeError as e:
                print(f"{t.name}: could not be used: {e}")
        names = {id(p): ("direct" if p is sim else p.name) for p in usable}
        lat: dict[str, list[float]] = {names[id(p)]: [] for p in usable}
        ttft: dict[str, list[float]] = {names[id(p)]: [] for p in usable}
        rps: dict[str, list[float]] = {names[id(p)]: [] for p in usable}
        cpu: dict[str, list[float]] = {names[id(p)]: [0.0, 0.0] for p in usable}
        for p in usable:  # warm-up: connections, caches, JITs
            await latency(p.port, 50, ONE_TOKEN, False)
        for rnd in range(args.rounds):
            order = usable if rnd % 2 == 0 else list(reversed(usable))
            for p in order:
                name = names[id(p)]
                c0 = cpu_s(p.proc.pid)
                lat[name] += await latency(p.port, args.requests, ONE_TOKEN, False)
                c1 = cpu_s(p.proc.pid)
                ttft[name] += await latency(p.port, args.stream_requests, STREAM_16, True)
                cpu[name][0] += c1 - c0
                cpu[name][1] += cpu_s(p.proc.pid) - c1
                rps[name].append(
                    await throughput(p.port, args.concurrency, args.duration_s, args.cap)
                )
        report(lat, ttft, rps, args, cpu)
        if args.profile:
            await profile_fleetgate(tmp, engine, args)
    finally:
        for t in targets:
            t.stop()
        sim.stop()
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs in {tmp}")
    return 0


def report(
    lat: dict[str, list[float]],
    ttft: dict[str, list[float]],
    rps: dict[str, list[float]],
    args: argparse.Namespace,
    cpu: dict[str, list[float]],
) -> None:
    base_p50, base_p99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
    base_ttft = pct(ttft["direct"], 0.5)
    print(
        f"\n1-token completions: {len(lat['direct'])} sequential requests per target; "
        f"req/s at concurrency {args.concurrency} for {args.duration_s}s x {args.rounds} rounds; "
        f"16-token streams: {len(ttft['direct'])} per target"
    )
    print(f"{'target':<14} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
          f"{'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'+TTFT ms':>9} "
          f"{'CPU/req ms':>10} {'CPU/stream ms':>13}")  # fmt: skip
    rows = {}
    for name in lat:
        p50, p99 = pct(lat[name], 0.5), pct(lat[name], 0.99)
        t50, t99 = pct(ttft[name], 0.5), pct(ttft[name], 0.99)
        r = statistics.median(rps[name])
        rows[name] = (p50 - base_p50, r)
        cpu_req, cpu_stream = cpu[name][0] / len(lat[name]), cpu[name][1] / len(ttft[name])
        print(
            f"{name:<14} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {(p50 - base_p50) * 1e3:8.3f} "
            f"{(p99 - base_p99) * 1e3:8.3f} {r:8.0f} {t50 * 1e3:9.3f} {t99 * 1e3:9.3f} "
            f"{(t50 - base_ttft) * 1e3:9.3f} {cpu_req * 1e3:10.3f} {cpu_stream * 1e3:13.3f}"
        )
    if "fg-relay" in rows:
        spliced, relay = ttft["fleetgate"], ttft["fg-relay"]
        extra_cpu = cpu["fleetgate"][1] / len(spliced) - cpu["fg-relay"][1] / len(relay)
        print(
            f"\nfleetgate (spliced) - fg-relay (raw relay): TTFT p50 "
            f"{(pct(spliced, 0.5) - pct(relay, 0.5)) * 1e3:+.3f} ms, CPU per 16-token stream "
            f"{extra_cpu * 1e3:+.3f} ms"
        )
    if "fleetgate" in rows and "vllm-router" in rows:
        fg_add, fg_rps = rows["fleetgate"]
        vr_add, vr_rps = rows["vllm-router"]
        ratio = fg_add / vr_add if vr_add > 0 else float("inf")
        print(
            f"\nfleetgate added p50 / vllm-router added p50 = {ratio:.2f} (target <= 1.5); "
            f"fleetgate req/s / vllm-router req/s = {fg_rps / vr_rps:.2f} (target >= 0.6)"
        )


async def profile_fleetgate(tmp: Path, engine: str, args: argparse.Namespace) -> None:
    out = tmp / "fleetgate.prof"
    (proc,) = start_targets(tmp, engine, True, out, fg_config=args.fleetgate_config)
    try:
        await proc.ready()
        await throughput(proc.port, args.concurrency, args.duration_s, args.cap)
    finally:
        proc.stop(signal.SIGINT)
    if not out.exists():
        print(f"profile: no output ({proc.log.read_text()[-500:]})")
        return
    print("\nfleetgate under cProfile (throughput phase), top 25 by own time:")
    stats = pstats.Stats(str(out))
    stats.sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--stream-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--cap", type=int, default=50_000, help="max requests per throughput run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--compare-loops", action="store_true", help="also run fleetgate on the asyncio loop"
    )
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--compare-relay",
        action="store_true",
        help="also run fleetgate with its splicer off (fg-relay: every stream relayed raw)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another fleetgate target fg-NAME run from DIR (PYTHONPATH), e.g. an older commit",
    )
    parser.add_argument(
        "--fleetgate-config",
        metavar="FILE.yaml",
        help="router config for fleetgate (e.g. with a 'priority: {}' section)",
    )
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
