"""Every command line and options file the operator can write for TensorRT-LLM is one
the target release accepts, checked against the contract data read from
TensorRT-LLM's source (``data/trtllm_contract.yaml``, each fact with file and version).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import ValidationError

from fleetgate.api.v1alpha1 import InferenceService, InferenceServiceSpec
from fleetgate.engines.base import EngineVersionError
from fleetgate.engines.trtllm import ADAPTER, CONFIG_FILE, ITERATION_STATS, TrtllmSettings
from fleetgate.engines.trtllm.versions import LINES, release_for, resolve_version
from fleetgate.operator import manifests

ROOT = Path(__file__).resolve().parents[2]
CONTRACT: dict[str, Any] = yaml.safe_load(
    (Path(__file__).parent / "data" / "trtllm_contract.yaml").read_text()
)["lines"]


def _flags(args: tuple[str, ...]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def _check(line: str, plan_args: tuple[str, ...], options: dict[str, Any], backend: str) -> None:
    facts = CONTRACT[line]
    accepted = set(facts["cli_flags"]["accepted"])
    for flag in _flags(plan_args):
        assert flag in accepted, f"{line}: trtllm-serve has no {flag}"
    assert plan_args[plan_args.index("--backend") + 1] in facts["backend_choices"]
    allowed = facts["options"]
    top = {"kv_cache_config", "scheduler_config", *allowed[f"top_level_{backend}"]}
    assert set(options) <= top, f"{line}/{backend}: unknown top-level keys {set(options) - top}"
    for section in ("kv_cache_config", "scheduler_config"):
        extra = set(options.get(section, {})) - set(allowed[section])
        assert not extra, f"{line}: {section} has no {extra}"
    events = options.get("kv_cache_config", {}).get("kv_events_config")
    if events is not None:
        extra = set(events) - set(allowed["kv_events_config"])
        assert not extra, f"{line}: kv_events_config has no {extra}"


def _setting_values() -> dict[str, list[Any]]:
    """Every value class of every CRD engine setting (Literals: all; optionals: unset/set)."""
    values: dict[str, list[Any]] = {}
    for name, field in TrtllmSettings.model_fields.items():
        choices = get_args(field.annotation)
        if choices and all(isinstance(c, str) for c in choices):
            values[name] = list(choices)
        elif field.annotation is bool:
            values[name] = [True, False]
        elif field.annotation == bool | None:
            values[name] = [None, True, False]
        elif field.default is None:
            values[name] = [None, 64]
        else:
            values[name] = [field.default]
    return values


def _settings_grid() -> list[TrtllmSettings]:
    values = _setting_values()
    names = list(values)
    grid = []
    for combo in itertools.product(*(values[n] for n in names)):
        try:
            grid.append(TrtllmSettings(**dict(zip(names, combo, strict=True))))
        except ValidationError:
            continue  # a contradiction the CRD refuses (kvEvents without block reuse)
    return grid


def test_contract_covers_every_supported_line() -> None:
    assert sorted(CONTRACT) == sorted(r.line for r in LINES)
    for line, facts in CONTRACT.items():
        assert release_for(line) is release_for(line) and release_for(line).line == line
        assert resolve_version(None, facts["example_image"]).line == line


@pytest.mark.parametrize("line", [r.line for r in LINES])
@pytest.mark.parametrize("revision", [None, "abc123"])
def test_every_crd_setting_writes_only_what_the_release_accepts(
    line: str, revision: str | None
) -> None:
    image = CONTRACT[line]["example_image"]
    release = release_for(line)
    for settings in _settings_grid():
        spec = InferenceServiceSpec.model_validate(
            {
                "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": revision},
                "engine": {
                    "type": "tensorrt-llm",
                    "image": image,
                    "tensorrtLlm": settings.model_dump(by_alias=True, exclude_none=True),
                },
            }
        )
        launch = manifests.launch_spec("svc", spec)
        if revision and "--revision" not in CONTRACT[line]["cli_flags"]["accepted"]:
            with pytest.raises(EngineVersionError, match="--revision"):
                ADAPTER.container(launch)
            continue
        plan = ADAPTER.container(launch)
        options = yaml.safe_load(plan.config_files[CONFIG_FILE])
        _check(line, plan.args, options, settings.backend)
        assert plan.engine_version == line
        # never two readers of the iteration-stats queue
        bound = ADAPTER.for_version(line)
        if options.get("return_perf_metrics"):
            assert ITERATION_STATS not in bound.metrics_sources
        assert plan.metrics_path == bound.metrics_sources[0].path
        assert release.load_source == bound.metrics_sources[0].name


def test_every_example_writes_only_what_its_release_accepts() -> None:
    found = 0
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["spec"]["engine"]["type"] != "tensorrt-llm":
                continue
            found += 1
            isvc = InferenceService.model_validate(doc)
            engine = isvc.spec.engine
            release = resolve_version(engine.version, engine.image)
            plan = ADAPTER.container(manifests.launch_spec(doc["metadata"]["name"], isvc.spec))
            options = yaml.safe_load(plan.config_files[CONFIG_FILE])
            backend = engine.tensorrt_llm.backend if engine.tensorrt_llm else "pytorch"
            _check(release.line, plan.args, options, backend)
    assert found >= 1


@pytest.mark.parametrize("line", [r.line for r in LINES])
def test_priority_only_where_the_request_model_has_it(line: str) -> None:
    bound = ADAPTER.for_version(line)
    fields = bound.priority_fields(5)
    if CONTRACT[line]["requests"]["priority"]:
        assert set(fields) == {"priority"} and 0.0 <= fields["priority"] <= 1.0
    else:
        assert fields == {}


@pytest.mark.parametrize(
    ("image", "version", "line"),
    [
        ("nvcr.io/nvidia/tensorrt-llm/release:1.0.0", None, "1.0"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.0.0rc4", None, "1.0"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.2.0rc3", None, "1.1"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.1.0-py3", None, "1.1"),
        ("registry.local/trt@sha256:abc", "main", "main"),
        ("registry.local/trt:latest", "1.0.1", "1.0"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc1", None, "1.3"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.3.0", None, "1.3"),
        ("nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4", None, "main"),
    ],
)
def test_release_from_version_or_image_tag(image: str, version: str | None, line: str) -> None:
    assert resolve_version(version, image).line == line


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("registry.local/trt:latest", None),
        ("registry.local/trt", None),
        ("nvcr.io/nvidia/tensorrt-llm/release:0.21.0", None),
        ("x:1.0.0", "banana"),
    ],
)
def test_unknown_release_is_an_error_that_says_what_to_set(image: str, version: str | None) -> None:
    with pytest.raises(EngineVersionError, match="1.0.x, 1.1.x, 1.2.x, 1.3.x or main"):
        resolve_version(version, image)
