"""Benchmark scenarios: a workload, its load level, the emulated fleet (pure).

A scenario fixes everything a contender must not influence: the sessions
(from the seed), the fleet file for ``fleetgate sim --fleet`` and the TTFT
objectives. All times in a scenario are *modelled* seconds (what an H100 would
take, per the emulator's calibrated profiles in ``fleetgate/sim/core/timing.py``).
The emulator runs ``time_scale`` wall seconds per modelled second so that a
2-core machine is not the bottleneck; :func:`wall_sessions` stretches the
arrival schedule and think times by the same factor, and the runner divides
measured latencies by it again. Router overhead is therefore divided by the
time scale too: it is reported separately as router CPU seconds.

Fleets: ``vllm-llama8b-h100`` engines (vLLM 0.x model of Llama-3.1-8B on one
H100) with a reduced KV cache (``num_gpu_blocks``) so that a few long
documents fill it and routing decides what stays cached, as on a busy real
fleet. ``mixed`` fleets alternate vLLM and TensorRT-LLM (``trtllm-llama8b-h100``,
the faster NIM-calibrated profile) engines, vLLM first (5 engines: 3 + 2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fleetgate.sim.core.timing import Profile, engine_config, resolve_profile
from fleetgate_tools.bench.workloads import Session, WorkloadParams, build

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    generator: str
    """Key of ``workloads.WORKLOADS``."""
    rate_per_engine: float
    """Session arrivals per modelled second per engine (near saturation)."""
    scale: float
    ttft_objective_s: dict[str, float]
    """Per priority class, modelled seconds; key ``*`` for any class."""
    mixed: bool = False
    shape: str = "docs"
    """Key of :data:`ENGINE_SHAPES`."""


#: Engine settings per fleet shape (emulator override names, vLLM / TRT vocabulary).
#: ``docs``: ~64k tokens of KV per engine, a dozen 3000-token documents but not
#: all of them. ``chat``: 16 running sequences and ~16k tokens of KV, so that
#: a few dozen conversations saturate an engine (cheap to emulate on 2 cores); its
#: engines run priority queues, as fleetgate deploys vLLM (since 2026-12-07: a
#: router that sends no priority, or one level for all, sees the FCFS waiting order).
#: ``priority``: 8 running sequences and the engines' priority queues switched
#: on (``--scheduling-policy priority`` / ``waiting_queue_policy``), as fleetgate
#: deploys them so that its per-request levels reach the engine schedulers.
#: ``evict``: 8192 tokens of KV per engine (512 vLLM blocks of 16, 256 TensorRT-LLM
#: blocks of 32), about five 1500-token documents: the ``evictions`` workload's
#: working set is 2.5x the fleet's cache.
ENGINE_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "docs": {
        "vllm": {"num_gpu_blocks": 4096, "max_num_seqs": 64, "max_model_len": 16384},
        "trtllm": {"num_gpu_blocks": 2048, "max_batch_size": 64, "max_model_len": 16384},
    },
    "chat": {
        "vllm": {
            "num_gpu_blocks": 1024,
            "max_num_seqs": 16,
            "max_model_len": 8192,
            "scheduling_policy": "priority",
        },
        "trtllm": {
            "num_gpu_blocks": 512,
            "max_batch_size": 16,
            "max_model_len": 8192,
            "scheduling_policy": "priority",
        },
    },
    "evict": {
        "vllm": {"num_gpu_blocks": 512, "max_num_seqs": 32, "max_model_len": 4096},
        "trtllm": {"num_gpu_blocks": 256, "max_batch_size": 32, "max_model_len": 4096},
    },
    "priority": {
        "vllm": {
            "num_gpu_blocks": 1024,
            "max_num_seqs": 8,
            "max_model_len": 8192,
            "scheduling_policy": "priority",
        },
        "trtllm": {
            "num_gpu_blocks": 512,
            "max_batch_size": 8,
            "max_model_len": 8192,
            "scheduling_policy": "priority",
        },
    },
}


#: name -> load. Base rates (load factor 1) were set from short calibration
#: runs on 4 engines (docs/bench.md) to sit near the knee of the TTFT curve;
#: the priority workloads offer about 1.5x what the fleet can serve.
LOADS: dict[str, Load] = {
    "chat-multiturn": Load("chat-multiturn", 11.0, 0.5, {"*": 1.0}, shape="chat"),
    "shared-prefix": Load("shared-prefix", 8.0, 1.0, {"*": 1.0}, shape="docs"),
    "agentic": Load("agentic", 2.0, 1.0, {"*": 1.0}, shape="docs"),
    "priority-storm": Load(
        "priority-storm", 11.0, 0.5, {"critical": 0.5, "batch": 10.0, "*": 2.0}, shape="priority"
    ),
    "mixed-traffic": Load(
        "mixed-traffic",
        8.0,
        0.5,
        {"critical": 0.5, "batch": 10.0, "*": 1.0},
        mixed=True,
        shape="priority",
    ),
    # the demo: the router's default class objectives (priority/config.py
    # DEFAULT_CLASSES), a flood sized from the fleet's slots; rate unused
    "flood": Load(
        "flood",
        0.0,
        1.0,
        {"critical": 0.5, "standard": 2.0, "batch": 60.0, "*": 2.0},
        mixed=True,
        shape="priority",
    ),
    # guesses go stale: rates not calibrated on a knee (docs/bench.md)
    "evictions": Load("evictions", 4.0, 1.0, {"*": 1.0}, shape="evict"),
    "flash-crowd": Load("flash-crowd", 2.0, 1.0, {"*": 2.0}, shape="docs"),
    "mixed-engine": Load(
        "priority-storm",
        11.0,
        0.5,
        {"critical": 0.5, "batch": 10.0, "*": 2.0},
        mixed=True,
        shape="priority",
    ),
}

PROFILES = {"vllm": "vllm-llama8b-h100", "trtllm": "trtllm-llama8b-h100"}


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    load: Load
    engines: int
    duration_s: float
    """Modelled seconds of arrivals."""
    time_scale: float
    seed: int
    load_factor: float = 1.0
    mixed: bool = False

    @property
    def rate(self) -> float:
        return self.load.rate_per_engine * self.engines * self.load_factor

    def params(self) -> WorkloadParams:
        return WorkloadParams(
            duration_s=self.duration_s,
            rate=self.rate,
            scale=self.load.scale,
            seed=self.seed,
            slots=self.slots(),
            cache_tokens=self.cache_tokens(),
        )

    def profile(self, kind: str) -> Profile:
        """The emulator profile an engine of ``kind`` runs in this fleet (its shape's
        overrides applied)."""
        return resolve_profile(PROFILES[kind], ENGINE_SHAPES[self.load.shape][kind])

    def cache_tokens(self) -> int:
        """KV-cache tokens of the whole fleet (blocks x block size, the emulator's
        own defaults where the shape does not set them)."""
        total = 0
        for kind in self.engine_kinds():
            cfg = engine_config(kind, self.profile(kind))  # type: ignore[arg-type]
            total += cfg.num_blocks * cfg.block_size
        return total

    def lone_prefill_seconds(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Modelled seconds to a first token of a prompt alone on an idle engine of
        this fleet, on its fastest engine kind (the emulator profile's cost model)."""
        return min(
            self.profile(kind).lone_prefill_seconds(uncached_tokens, cached_tokens)
            for kind in set(self.engine_kinds())
        )

    def lone_answer_seconds(self, prompt_tokens: int, output_tokens: int) -> float:
        """Modelled seconds of a whole answer alone on an idle engine of the fastest
        kind: the prompt's prefill, then one decode step per further token (where the
        hit-rate references place a conversation's later turns in time)."""

        def one(kind: str) -> float:
            p = self.profile(kind)
            step = p.fixed_s + p.decode_seq_s + p.kv_token_s * (prompt_tokens + output_tokens / 2)
            return p.lone_prefill_seconds(prompt_tokens) + max(0, output_tokens - 1) * step

        return min(one(kind) for kind in set(self.engine_kinds()))

    def slots(self) -> int:
        """Concurrent sequences of the whole fleet (0 when a limit is unknown)."""
        caps = [self.capacity(k) for k in self.engine_kinds()]
        return 0 if any(c is None for c in caps) else sum(c or 0 for c in caps)

    def sessions(self) -> list[Session]:
        return build(self.load.generator, self.params())

    def engine_kinds(self) -> list[str]:
        if self.mixed or self.load.mixed:
            return ["vllm" if i % 2 == 0 else "trtllm" for i in range(self.engines)]
        return ["vllm"] * self.engines

    def capacity(self, kind: str) -> int | None:
        """An engine's concurrent-sequence limit from its shape (None = profile default)."""
        shape = ENGINE_SHAPES[self.load.shape][kind]
        limit = shape.get("max_num_seqs", shape.get("max_batch_size"))
        return int(limit) if limit is not None else None

    def objective(self, priority_class: str) -> float:
        o = self.load.ttft_objective_s
        return o.get(priority_class, o["*"])

    def fleet_file(self, ports: list[int], kv_events: bool = False) -> dict[str, Any]:
        """``fleetgate sim --fleet`` YAML (as a dict) on the given loopback ports;
        ``kv_events``: every engine publishes KV-cache events."""
        kinds = self.engine_kinds()
        if len(ports) != len(kinds):
            raise ValueError(f"need {len(kinds)} ports, got {len(ports)}")
        return {
            "model": MODEL,
            "time_scale": self.time_scale,
            "seed": self.seed,
            "engines": [
                {
                    "kind": k,
                    "profile": PROFILES[k],
                    "port": p,
                    "overrides": dict(ENGINE_SHAPES[self.load.shape][k]),
                    **({"kv_events": True} if kv_events else {}),
                }
                for k, p in zip(kinds, ports, strict=True)
            ],
        }


def make(
    name: str,
    *,
    engines: int,
    time_scale: float,
    seed: int,
    duration_s: float | None = None,
    modelled_s: float | None = None,
    load_factor: float = 1.0,
    mixed: bool = False,
) -> Scenario:
    """Give exactly one of ``duration_s`` (WALL seconds of arrivals, divided by the
    time scale: the demo's and ``bench infperf``'s meaning) or ``modelled_s``
    (modelled seconds of arrivals: ``bench run --duration``). The scenario holds
    modelled seconds."""
    if name not in LOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(LOADS)}")
    if engines < 1:
        raise ValueError("--engines must be >= 1")
    if (duration_s is None) == (modelled_s is None):
        raise ValueError("give exactly one of duration_s (wall) and modelled_s")
    length = modelled_s if modelled_s is not None else duration_s
    assert length is not None
    if length <= 0 or time_scale <= 0 or load_factor <= 0:
        raise ValueError("duration, time scale and load factor must be > 0")
    return Scenario(
        name=name,
        load=LOADS[name],
        engines=engines,
        duration_s=length if modelled_s is not None else length / time_scale,
        time_scale=time_scale,
        seed=seed,
        load_factor=load_factor,
        mixed=mixed,
    )


def parse_warmup(text: str) -> tuple[float, bool]:
    """``--warmup``: (modelled seconds, False) or (percent of the window, True)."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw.removesuffix("%"))
    except ValueError:
        raise ValueError(f"--warmup {text!r}: modelled seconds or a percentage like 10%") from None
    if value < 0 or (percent and value >= 100):
        raise ValueError("--warmup must be >= 0 and below 100%")
    return value, percent


def parse_seed_list(text: str, most: int = 20) -> list[int]:
    """``--seeds 0,1,2``: distinct integers, at most ``most`` of them."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected integers like 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError("--seeds: give distinct integers")
    if len(seeds) > most:
        raise ValueError(f"--seeds: at most {most}")
    return seeds


#: ``--time-scale auto``: the share of the machine's cores that the emulator, the
#: router(s), the round-robin front and the load generator may use together.
TARGET_CPU_SHARE = 0.7
#: ``--time-scale auto``: the scale of the calibration run is 2 x engines (the old
#: default); it lasts this many modelled seconds.
CALIBRATION_MODELLED_S = 3.0


def choose_time_scale(
    calibration_scale: float,
    cpu_seconds: float,
    wall_s: float,
    cores: int,
    target: float = TARGET_CPU_SHARE,
    step: float = 0.5,
    lowest: float = 1.0,
    idle_share: float = 0.0,
) -> float:
    """The smallest time scale (a multiple of ``step``, at least ``lowest``) at which
    the CPU measured in a calibration run would stay under ``target`` of ``cores``.

    A run's share of the machine is ``idle + work / scale``: ``idle_share`` is what
    the processes use per WALL second with no load (each router scraping every
    engine 5 times a second, the emulator's tickers), measured before the load;
    the rest is work per modelled second, which falls as 1 / scale. A run that
    used ``cpu_seconds`` in ``wall_s`` at ``calibration_scale`` (share = cpu /
    (wall x cores)) therefore needs ``calibration_scale x (share - idle) /
    (target - idle)``. The report shows the measured shares of the real run.
    """
    if calibration_scale <= 0 or wall_s <= 0 or cores < 1 or not 0 < target <= 1:
        raise ValueError("calibration scale, wall time, cores and target must be positive")
    if cpu_seconds < 0 or idle_share < 0:
        raise ValueError("cpu seconds and the idle share must be >= 0")
    share = cpu_seconds / (wall_s * cores)
    idle = min(idle_share, share)
    if idle >= target:
        raise ValueError(
            f"the idle processes alone use {idle:.0%} of the machine (target {target:.0%})"
        )
    needed = calibration_scale * (share - idle) / (target - idle)
    return max(lowest, math.ceil(needed / step - 1e-9) * step)


def wall_sessions(sessions: list[Session], time_scale: float) -> list[Session]:
    """Stretch start times and think times from modelled to wall seconds."""
    return [
        dataclasses.replace(
            s,
            start_s=s.start_s * time_scale,
            turns=tuple(dataclasses.replace(t, think_s=t.think_s * time_scale) for t in s.turns),
        )
        for s in sessions
    ]
