"""The emulator run from the engines' own command lines (fleetgate/sim/entrypoints.py).

* Every command line the operator generates (each ``examples/*.yaml``, every CRD
  engine setting, ``extraArgs``; tests/engine_cmdlines.py) parses with no unknown
  flag except the extraArgs ones, and its settings reach the emulated engine.
* Each of them, run as a process (``python3 -m vllm.entrypoints.openai.api_server``
  -> ``fleetgate sim vllm api_server``, ``trtllm-serve`` -> ``fleetgate sim
  trtllm-serve``), starts, answers the probe paths of the generated manifest on the
  generated port, serves a completion and exits 0 on SIGTERM. The image tests
  (tests/image/) run the same lines through the emulator image's own entrypoints.
* ``fleetgate sim --vllm 2 --trtllm 1`` defaults to the Llama-3.1-8B profiles.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_cmdlines import EXTRA_ARGS, EngineContainer, cases, engine_container

from fleetgate.cli import CliError
from fleetgate.engines.trtllm import TrtllmSettings
from fleetgate.engines.trtllm.versions import resolve_version
from fleetgate.sim import entrypoints
from fleetgate.sim.fleet import EngineSpec, FleetError, build_engine, default_model_factory

CASES = cases()


def emulator_argv(c: EngineContainer, config_dir: Path | None = None) -> list[str]:
    """The container's command line as ``fleetgate sim`` takes it (what the image maps)."""
    args = list(c.args)
    if config_dir is not None:  # the ConfigMap's mount point, moved to a temp dir
        args = [a.replace(c.config_mount_path, str(config_dir)) for a in args]
    if c.command == ["python3", "-m", "vllm.entrypoints.openai.api_server"]:
        return ["vllm", "api_server", *args]
    if c.command == ["trtllm-serve"]:
        return ["trtllm-serve", *args]
    raise AssertionError(f"no emulator entrypoint for {c.command}")


def write_config(c: EngineContainer, where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for name, text in c.config_files.items():
        (where / name).write_text(text)
    return where


def engine_options(launch: entrypoints.EngineLaunch) -> Any:
    spec = entrypoints.engine_spec(launch, entrypoints.default_profile(launch.kind, launch.model))
    engine, _ = build_engine(spec, launch.model, default_model_factory(), 1.0, 0, 0.0)
    return engine.options, engine


@pytest.mark.parametrize("spec", CASES)
def test_generated_command_line_parses_and_configures(spec: dict[str, Any], tmp_path: Path) -> None:
    c = engine_container(spec)
    launch = entrypoints.parse(emulator_argv(c, write_config(c, tmp_path)))
    want_unknown = EXTRA_ARGS.get(c.spec.engine.type, []) if c.spec.engine.extra_args else []
    unknown_flags = [u.split()[0] for u in launch.unknown]
    assert unknown_flags == [a for a in want_unknown if a.startswith("--")], launch.unknown
    assert launch.port == c.port
    assert launch.host == "0.0.0.0"
    options, engine = engine_options(launch)
    if c.engine == "vllm":
        assert launch.model == c.served_model
        assert launch.prompt_tokens_details is True
        v = c.spec.engine.vllm
        if v is not None and v.max_model_len is not None:
            assert options.max_model_len == v.max_model_len
        if v is not None and v.max_num_seqs is not None:
            assert options.max_num_seqs == v.max_num_seqs
        if v is not None and v.block_size is not None:
            assert options.block_size == v.block_size
        if v is not None:
            assert engine.options.prefix_caching == v.enable_prefix_caching
        assert launch.overrides["scheduling_policy"] == (v.scheduling_policy if v else "priority")
    else:
        t = c.spec.engine.tensorrt_llm
        s = t if t is not None else TrtllmSettings()
        assert options.block_size == s.tokens_per_block
        assert engine.options.prefix_caching == s.enable_block_reuse
        release = resolve_version(c.spec.engine.version, c.spec.engine.image)
        # the 1.0/1.1 lines have no waiting_queue_policy: the operator does not write it
        expected = s.waiting_queue_policy if release.waiting_queue_policy else None
        assert launch.overrides.get("waiting_queue_policy") == expected
        assert launch.overrides["capacity_scheduler_policy"] == s.capacity_scheduler_policy
        if s.max_batch_size is not None:
            assert options.max_num_seqs == s.max_batch_size
    # flags with nothing to emulate are named in the log, not silently dropped
    if c.engine == "vllm":
        assert any(i.startswith("--gpu-memory-utilization") for i in launch.ignored)
    elif s.enable_attention_dp:  # then each tensor-parallel GPU is a rank
        assert launch.overrides["attention_dp_ranks"] == c.spec.parallelism.tensor
        assert not any(i.startswith("--tp_size") for i in launch.ignored)
    else:
        assert any(i.startswith("--tp_size") for i in launch.ignored)


def test_vllm_cli_forms_and_underscores() -> None:
    a = entrypoints.parse(["vllm", "serve", "org/m", "--max_model_len=8k", "--port", "9000"])
    assert (a.model, a.port, a.overrides["max_model_len"]) == ("org/m", 9000, 8000)
    b = entrypoints.parse(["vllm", "serve", "--model", "org/m", "--max-model-len", "8K"])
    assert (b.model, b.overrides["max_model_len"], b.host) == ("org/m", 8192, "0.0.0.0")
    c = entrypoints.parse(["vllm", "serve", "org/m", "--served-model-name", "a", "b", "--x", "1"])
    assert (c.model, c.unknown) == ("a", ("--x 1",))
    with pytest.raises(CliError, match="only 'vllm serve"):
        entrypoints.parse(["vllm", "bench", "latency"])
    with pytest.raises(CliError, match="no model"):
        entrypoints.parse(["vllm", "api_server", "--port", "1"])
    with pytest.raises(CliError, match="max-model-len"):
        entrypoints.parse(["vllm", "serve", "m", "--max-model-len", "lots"])


def test_vllm_lora_modules_name_adapters_served_beside_the_model() -> None:
    a = entrypoints.parse(
        ["vllm", "serve", "org/m", "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
         "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}']
    )  # fmt: skip
    assert a.lora_modules == ("sql", "chat") and "--max-lora-rank" in " ".join(a.ignored)
    spec = entrypoints.engine_spec(a, "test")
    assert spec.lora_modules == ["sql", "chat"]
    options, _ = engine_options(a)
    assert options.lora_modules == ("sql", "chat")
    with pytest.raises(FleetError, match="lora_modules is a vLLM option"):
        build_engine(EngineSpec(kind="trtllm", lora_modules=["sql"]), "m",
                     default_model_factory(), 1.0, 0, 0.0)  # fmt: skip
    with pytest.raises(CliError, match="needs --enable-lora"):
        entrypoints.parse(["vllm", "serve", "org/m", "--lora-modules", "sql=/a"])
    with pytest.raises(CliError, match="expected NAME=PATH"):
        entrypoints.parse(["vllm", "serve", "org/m", "--enable-lora", "--lora-modules", "sql"])


def test_trtllm_options_file_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "o.yaml"
    f.write_text(
        "kv_cache_config: {tokens_per_block: 64, enable_block_reuse: false, max_tokens: 9}\n"
        "max_seq_len: 4096\nmax_batch_size: 8\nspeculative_config: {decoding_type: Eagle}\n"
    )
    a = entrypoints.parse(
        ["trtllm-serve", "serve", "m", "--max-batch-size", "16", "--extra_llm_api_options", str(f)]
    )
    assert a.host == "localhost" and a.port == 8000
    assert a.overrides == {
        "tokens_per_block": 64,
        "enable_block_reuse": False,
        "max_model_len": 4096,
        "max_batch_size": 16,  # the flag wins over the file
    }
    assert a.unknown == (f"{f}: speculative_config={{'decoding_type': 'Eagle'}}",)
    assert f"{f}: kv_cache_config.max_tokens=9" in a.ignored
    f.write_text("[1, 2]\n")
    with pytest.raises(CliError, match="mapping"):
        entrypoints.parse(["trtllm-serve", "m", "--extra_llm_api_options", str(f)])


def test_profiles_are_realistic_by_default() -> None:
    assert entrypoints.default_profile("vllm", "meta-llama/Llama-3.1-8B-Instruct") == (
        "vllm-llama8b-h100"
    )
    assert entrypoints.default_profile("trtllm", "Llama-3.1-70B") == "trtllm-llama70b-4xh100"


def test_bind_host_is_loopback_in_test_mode() -> None:
    assert entrypoints.bind_host("0.0.0.0", {"FLEETGATE_TEST_MODE": "1"}) == "127.0.0.1"
    assert entrypoints.bind_host("0.0.0.0", {}) == "0.0.0.0"
    assert entrypoints.bind_host("localhost", {}) == "127.0.0.1"
    env = {"FLEETGATE_TEST_MODE": "1", entrypoints.ENV_BIND_HOST: "127.0.9.9"}
    assert entrypoints.bind_host("0.0.0.0", env) == "127.0.9.9"
    with pytest.raises(CliError, match="loopback"):
        entrypoints.bind_host("0.0.0.0", {**env, entrypoints.ENV_BIND_HOST: "10.0.0.1"})


# ----------------------------------------------------------------------- processes
def loopback_address() -> str:
    """A 127/8 address of this test alone (the engines' port 8000 is shared)."""
    return f"127.{random.randint(64, 250)}.{random.randint(0, 255)}.{random.randint(2, 250)}"


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode}: {proc.communicate()[1]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy in {timeout} s")


def check_serves(url: str, c: EngineContainer) -> None:
    """The manifest's probes answer 200 and a chat completion streams."""
    for kind, path in c.probes.items():
        assert httpx.get(url + path, timeout=5).status_code == 200, kind
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    if c.engine == "vllm":
        assert model == c.served_model
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]


@pytest.mark.slow
@pytest.mark.parametrize("spec", CASES)
def test_generated_command_line_runs(spec: dict[str, Any], tmp_path: Path) -> None:
    c = engine_container(spec)
    host = loopback_address()
    env = {
        **os.environ,
        "FLEETGATE_TEST_MODE": "1",
        entrypoints.ENV_BIND_HOST: host,
        entrypoints.ENV_TIME_SCALE: "0.01",
    }
    argv = emulator_argv(c, write_config(c, tmp_path / "config"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetgate", "sim", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://{host}:{c.port}"
        wait_healthy(url, proc)
        check_serves(url, c)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "emulating" in err and "0.0.0.0" in err  # the test-mode bind is logged
    assert err.count("unknown to the emulator") == (1 if c.spec.engine.extra_args else 0), err


def test_fleet_cli_defaults_to_llama8b_profiles() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "fleetgate", "sim", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(p.stdout.split())
    assert "vllm-llama8b-h100" in text and "for unit tests only" in text, text
    from fleetgate.sim import cli

    parser = __import__("argparse").ArgumentParser()
    cli.build_parser(parser)
    specs, *_ = cli.resolve(parser.parse_args(["--vllm", "2", "--trtllm", "1"]))
    assert [s.profile for s in specs] == ["vllm-llama8b-h100"] * 2 + ["trtllm-llama8b-h100"]
    for s in specs:
        options, _ = engine_options(
            entrypoints.EngineLaunch(kind=s.kind, model="m", host="h", port=1)
        )
        assert options.max_model_len >= 8192
