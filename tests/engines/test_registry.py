"""The engine registry: lookup by name/alias, Protocol conformance, one-file extension."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import fleetgate.engines as engines
from fleetgate.api.v1alpha1 import EngineSpec
from fleetgate.engines import UnknownEngineError, adapters, get_adapter
from fleetgate.engines.base import EngineAdapter, LaunchSpec, LoadSnapshot, TokenEventShapes
from fleetgate.engines.trtllm import TrtllmAdapter
from fleetgate.engines.vllm import VllmAdapter
from fleetgate.router import k8s_addresses as ka
from fleetgate.router import k8s_targets as kt


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("vllm", VllmAdapter),
        ("VLLM", VllmAdapter),
        ("trtllm", TrtllmAdapter),
        ("tensorrt-llm", TrtllmAdapter),
        ("tensorrt_llm", TrtllmAdapter),
        ("trt-llm", TrtllmAdapter),
        ("TensorRT-LLM", TrtllmAdapter),
    ],
)
def test_get_adapter_by_name_or_alias(name: str, cls: type) -> None:
    assert isinstance(get_adapter(name), cls)


@pytest.mark.parametrize("name", ["sglang", "", "vllm ", "tensorrt"])
def test_unknown_engine(name: str) -> None:
    with pytest.raises(UnknownEngineError, match="unknown engine") as info:
        get_adapter(name)
    assert isinstance(info.value, KeyError)
    assert "trtllm" in str(info.value) and "vllm" in str(info.value)


def test_registry_holds_both_engines_with_distinct_names() -> None:
    found = adapters()
    assert set(found) >= {"vllm", "trtllm"}
    names = [n for a in found.values() for n in (a.name, *a.aliases)]
    assert len(names) == len(set(names)), "a name or alias is claimed twice"
    assert all(n == n.lower() for n in names)


@pytest.mark.parametrize("name", ["vllm", "trtllm"])
def test_adapters_satisfy_the_protocol(name: str) -> None:
    adapter = get_adapter(name)
    assert isinstance(adapter, EngineAdapter)
    assert adapter.metrics_sources, "an adapter needs at least one metrics source"
    assert adapter.default_block_size > 0
    adapter.settings_model()  # defaults are valid on their own


@pytest.mark.parametrize("name", ["vllm", "trtllm"])
def test_spec_key_names_the_adapters_settings_section(name: str) -> None:
    """The InferenceService stores each engine's settings under the adapter's key."""
    adapter = get_adapter(name)
    engine = EngineSpec.model_validate(
        {"type": name if name == "vllm" else "tensorrt-llm", "image": "img:1", adapter.spec_key: {}}
    )
    assert isinstance(engine.settings_for(adapter.spec_key), adapter.settings_model)
    assert engine.settings_for("noSuchSection") is None


@pytest.mark.parametrize(
    "name, settings, tensor, want",
    [
        pytest.param("vllm", {"maxNumSeqs": 32}, 4, 32, id="vllm-tp-one-scheduler"),
        pytest.param("vllm", {}, 1, None, id="vllm-unset"),
        pytest.param("vllm", {"maxNumSeqs": True}, 1, None, id="vllm-bool"),
        pytest.param("trtllm", {"maxBatchSize": 64}, 4, 64, id="trt-tp"),
        pytest.param(
            "trtllm", {"maxBatchSize": 64, "enableAttentionDp": True}, 4, 256, id="trt-adp"
        ),
        pytest.param("trtllm", {"maxBatchSize": 0}, 1, None, id="trt-zero"),
        pytest.param("trtllm", {"maxBatchSize": "64"}, 1, None, id="trt-string"),
    ],
)
def test_concurrency_limit(
    name: str, settings: dict[str, object], tensor: int, want: int | None
) -> None:
    assert get_adapter(name).concurrency_limit(settings, tensor) == want


@pytest.mark.parametrize("name", ["vllm", "trtllm"])
def test_token_event_shapes_keep_the_contract(name: str) -> None:
    """Each pattern captures ``text`` (and maybe ``ids``) and nothing else by name."""
    shapes = get_adapter(name).token_events
    assert isinstance(shapes, TokenEventShapes)
    for kind in ("chat", "completions"):
        patterns = shapes.for_kind(kind)
        assert patterns, f"{name} declares no {kind} shape"
        for p in patterns:
            assert "text" in p.groupindex and set(p.groupindex) <= {"text", "ids"}
            assert p.pattern.endswith(rb"\n\n")  # to the end of the event


def test_non_adapters_fail_the_protocol_check() -> None:
    class Partial:
        name = "partial"
        aliases = ()

    assert not isinstance(Partial(), EngineAdapter)


TOY_ENGINE = '''
"""A throwaway engine used to prove that one file adds an engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from fleetgate.engines.base import (
    ContainerPlan, ErrorInfo, LaunchSpec, LoadSnapshot, MetricsSource, Probe, TokenEventShapes,
)


class ToySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    speed: int = 1


class ToyAdapter:
    name = "toyengine"
    aliases = ("toy",)
    default_block_size = 8
    settings_model = ToySettings
    spec_key = "toy"
    metrics_sources = (MetricsSource("load", "/load", "json"),)
    accepts_token_ids_prompt = False
    returns_token_ids = False
    continues_final_message = False
    token_events = TokenEventShapes()  # no fast path: every streamed event is read as JSON

    def parse_metrics(self, source, body, now, previous):
        return LoadSnapshot(scraped_at=now, running=int(body), source=source.name)

    def priority_fields(self, level: int) -> dict[str, Any]:
        return {"urgency": level}

    def error_body(self, status, message, err_type, param=None):
        return {"msg": message}

    def classify_error(self, status, body):
        return ErrorInfo(status=status, kind="client", message=body.decode())

    def container(self, launch: LaunchSpec) -> ContainerPlan:
        probe = Probe("/ready")
        return ContainerPlan(("toy",), (launch.model_path,), launch.port, probe, probe, probe,
                             "/load")

    def decode_kv_events(self, frames):
        return ()  # publishes none: ContainerPlan.kv_events stays None

    def kv_replay_request(self, start):
        raise NotImplementedError("publishes no events: nothing to replay")

    def lora_adapter(self, card):
        return None  # no adapters

    def request_lora_salt(self, doc):
        return None

    def schedulers(self, settings, tensor_parallel):
        return settings.get("lanes", 1)

    def concurrency_limit(self, settings, tensor_parallel):
        return settings.get("slots")


ADAPTER = ToyAdapter()
'''


@pytest.fixture
def toy_engine_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on the engines package path holding exactly one new module."""
    (tmp_path / "toyengine.py").write_text(textwrap.dedent(TOY_ENGINE))
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(tmp_path)])
    adapters.cache_clear()
    try:
        yield tmp_path
    finally:
        sys.modules.pop("fleetgate.engines.toyengine", None)
        adapters.cache_clear()


def _pod() -> dict[str, object]:
    """A ready pod of InferenceService ``ns/m`` on a loopback address."""
    return {
        "metadata": {"name": "m-0", "namespace": "ns", "labels": {ka.LABEL_INSTANCE: "m"}},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": "127.0.1.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_one_new_file_adds_an_engine(toy_engine_dir: Path) -> None:
    toy = get_adapter("TOY")
    assert toy.name == "toyengine"
    assert isinstance(toy, EngineAdapter)
    assert set(adapters()) >= {"vllm", "trtllm", "toyengine"}
    # The new engine works through the Protocol like the built-in ones.
    source = toy.metrics_sources[0]
    assert toy.parse_metrics(source, b"3", 1.0, None) == LoadSnapshot(
        scraped_at=1.0, running=3, source="load"
    )
    assert toy.priority_fields(4) == {"urgency": 4}
    assert toy.container(LaunchSpec("/w", "w", 1234)).metrics_path == "/load"
    # and discovery reads its capacity through the adapter, knowing no field of its own
    found = ka.addresses_from_pod(_pod(), "http")
    svc = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"engine": {"type": "toy", "toy": {"slots": 7}}},
    }
    config = kt.KubernetesDiscoveryConfig()
    (target,) = kt.desired_targets(found, {("ns", "m"): svc}, config).values()
    assert (target.engine, target.capacity) == ("toyengine", 7)


def test_the_throwaway_engine_is_gone_afterwards() -> None:
    assert "toyengine" not in adapters()
    with pytest.raises(UnknownEngineError):
        get_adapter("toy")
