"""What router replicas' ``/metrics`` scrapes cost the engines, at the old and new intervals.

    .venv/bin/python bench/bench_scrape_cost.py [--engines 2] [--window-s 10]
        [--replicas 1,2] [--json OUT]

One ``fleetgate sim --vllm N --kv-events`` process (N emulated vLLM engines,
time scale 0, all on 127.0.0.1), then for each phase R router processes
(``fleetgate router``, each with every engine's KV-event feed and the emulator's
tokenizer), no client traffic. Once every router has all feeds ``live``, the
engine process's CPU (utime + stime from /proc, 10 ms ticks) is read over
``--window-s`` seconds, and each router's ``fleetgate_scrape_duration_seconds_count``
(scrapes done) before and after. Phases:

  baseline   no router: the engines' own idle CPU (their loops, the KV publishers)
  old        ``scrape.interval_with_events_s: null``: every 0.2 s, as before
  busy       0.5 s: the interval a live feed gets while the engine is busy
             (forced here by setting the idle interval to it as well)
  idle       the defaults (0.5 s busy, 1.5 s quiet): what idle engines get

Reported per phase: scrapes per second per replica per engine, the engine
process's CPU share (% of one core) minus the baseline, that per replica, CPU per
scrape, and the bytes per second a real vLLM 0.32 exposition (sizes read from
the conformance fixtures, if present) would cost at that scrape rate.

The emulator renders its exposition in the same process as its engines; a real
vLLM renders it in its API-server process. Everything shares the machine's cores
with whatever else runs: treat the CPU figures as an order of magnitude and the
scrape counts as exact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
MODEL = "m"
FIXTURES = Path(os.environ.get("FLEETGATE_VLLM_FIXTURES", "/work/shared/fixtures/vllm-0.32-cpu"))
PHASES: dict[str, dict[str, object]] = {
    "old": {"interval_s": 0.2, "interval_with_events_s": None},
    "busy": {"interval_s": 0.2, "interval_with_events_s": 0.5, "idle_interval_with_events_s": 0.5},
    "idle": {"interval_s": 0.2},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def wait_for(pred: object, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if pred():  # type: ignore[operator]
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def scrapes_done(router: str) -> float:
    text = get(router + "/metrics")
    return sum(
        float(m.group(1))
        for m in re.finditer(
            r"^fleetgate_scrape_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M
        )
    )


def feeds_live(router: str, engines: int) -> bool:
    text = get(router + "/metrics")
    live = re.findall(r'^fleetgate_kv_feed_state\{[^}]*state="live"[^}]*\} 1\.0$', text, re.M)
    return len(live) == engines


def vllm_exposition_bytes() -> int | None:
    sizes = [p.stat().st_size for p in FIXTURES.glob("metrics_*.prom.txt")]
    return int(statistics.median(sizes)) if sizes else None


def start_sim(tmp: Path, engines: int) -> tuple[subprocess.Popen[bytes], list[str]]:
    log = tmp / "sim.log"
    port = free_port()
    with open(log, "wb") as out:
        sim = subprocess.Popen(
            [sys.executable, "-m", "fleetgate", "sim", "--vllm", str(engines), "--kv-events",
             "--port", str(port), "--host", HOST, "--time-scale", "0", "--model", MODEL],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    backends: list[str] = []

    def started() -> bool:
        nonlocal backends
        if sim.poll() is not None:
            raise SystemExit("the emulator exited:\n" + log.read_text()[-2000:])
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("engine=")]
        backends = []
        for ln in lines:
            kv = dict(f.split("=", 1) for f in ln.split())
            backends.append(
                f"vllm={kv['url']},kv_events={kv['kv_events']},kv_replay={kv['kv_replay']}"
            )
        return len(backends) == engines

    wait_for(started, "the emulated engines")
    return sim, backends


def start_routers(
    tmp: Path, n: int, backends: list[str], scrape: dict[str, object], tag: str
) -> list[tuple[subprocess.Popen[bytes], str]]:
    cfg = tmp / f"router-{tag}.json"  # YAML is a superset of JSON
    cfg.write_text(json.dumps({"test_mode": True, "scrape": scrape}))
    out = []
    for i in range(n):
        port = free_port()
        with open(tmp / f"router-{tag}-{i}.log", "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "fleetgate", "router", "--host", HOST, "--port", str(port),
                 "--config", str(cfg), "--tokenizer", f"{MODEL}=emulator"]
                + [a for b in backends for a in ("--backend", b)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        out.append((p, f"http://{HOST}:{port}"))
    return out


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(sim_pid: int, routers: list[str], window: float) -> dict[str, float]:
    before = [scrapes_done(r) for r in routers]
    c0, t0 = cpu_s(sim_pid), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_s(sim_pid), time.monotonic()
    after = [scrapes_done(r) for r in routers]
    wall = t1 - t0
    return {
        "wall_s": wall,
        "engine_cpu_pct": 100.0 * (c1 - c0) / wall,
        "scrapes": sum(a - b for a, b in zip(after, before, strict=True)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if os.environ.get("FLEETGATE_TEST_MODE") != "1":
        raise SystemExit("run with FLEETGATE_TEST_MODE=1 (everything stays on loopback)")
    tmp = Path(tempfile.mkdtemp(prefix="fg-bench-scrape-"))
    sim, backends = start_sim(tmp, args.engines)
    rows: list[dict[str, object]] = []
    try:
        time.sleep(1.0)
        base = measure(sim.pid, [], args.window_s)
        rows.append({"phase": "baseline", "replicas": 0, **base})
        print(f"baseline: engine process {base['engine_cpu_pct']:.2f}% of a core", flush=True)
        for n in (int(x) for x in args.replicas.split(",")):
            for phase, scrape in PHASES.items():
                routers = start_routers(tmp, n, backends, scrape, f"{phase}-{n}")
                try:
                    for _, url in routers:
                        wait_for(lambda url=url: get(url + "/ready") is not None, "router ready")
                        wait_for(lambda url=url: feeds_live(url, args.engines), "feeds live")
                    time.sleep(2.0)  # past the first scrapes and the start-up
                    m = measure(sim.pid, [u for _, u in routers], args.window_s)
                finally:
                    stop([p for p, _ in routers])
                extra = m["engine_cpu_pct"] - base["engine_cpu_pct"]
                per_s = m["scrapes"] / m["wall_s"] / n / args.engines
                row: dict[str, object] = {
                    "phase": phase,
                    "replicas": n,
                    **m,
                    "scrapes_per_s_per_replica_per_engine": per_s,
                    "engine_cpu_pct_over_baseline": extra,
                    "engine_cpu_pct_per_replica": extra / n,
                    "engine_cpu_ms_per_scrape": 1000.0
                    * extra
                    / 100.0
                    * m["wall_s"]
                    / max(1.0, m["scrapes"]),
                }
                rows.append(row)
                print(
                    f"{phase:5s} replicas={n}: {per_s:.2f} scrapes/s per replica per engine, "
                    f"engine CPU +{extra:.2f}% of a core over baseline "
                    f"({extra / n:.2f}% per replica, "
                    f"{row['engine_cpu_ms_per_scrape']:.2f} ms per scrape)",
                    flush=True,
                )
    finally:
        stop([sim])
    size = vllm_exposition_bytes()
    if size is not None:
        print(f"real vLLM 0.32 exposition: {size} bytes (median of the fixtures)")
        for r in rows[1:]:
            rate = float(r["scrapes_per_s_per_replica_per_engine"])  # type: ignore[arg-type]
            r["vllm_bytes_per_s_per_replica_per_engine"] = rate * size
            print(
                f"  {r['phase']:5s} replicas={r['replicas']}: "
                f"{rate * size / 1024:.0f} KiB/s per replica per engine"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"engines": args.engines, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
