"""Engine-neutral helpers shared by the adapters: a minimal, fast Prometheus
text scanner, numeric and error-body checks, launch validation, and the regex
pieces of :class:`~fleetgate.engines.base.TokenEventShapes`.

Private (underscore) so the registry never mistakes it for an engine module.
Pure: standard library and pydantic only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel

from fleetgate.engines.base import (
    LEVEL_MAX,
    LEVEL_MIN,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    EngineError,
    KvEventsDecodeError,
    LaunchSpec,
    MetricsParseError,
)

# --------------------------------------------------------------------------------------
# A minimal Prometheus text-format scanner
# --------------------------------------------------------------------------------------


class PromSample(NamedTuple):
    """One sample line of a wanted family: its labels by name, and its value.

    A NamedTuple rather than a frozen dataclass: it is built once per matched line on
    every scrape, and a tuple is several times cheaper to construct.
    """

    labels: Mapping[str, str]
    value: float


_LABEL_BLOCK_RE = re.compile(
    r'\{((?:\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"[^"\\\n]*(?:\\.[^"\\\n]*)*"\s*,?)*)\s*\}'
)
_LABEL_PAIR_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r'\\[\\"n]')
_MAX_LINE_IN_ERROR = 160


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_LINE_IN_ERROR else text[:_MAX_LINE_IN_ERROR] + "..."


def _unescape(value: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def _parse_sample(name: str, rest: bytes) -> PromSample:
    """Parse what follows a sample name: ``[{labels}] value [timestamp]``."""
    try:
        line = rest.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as exc:
        raise MetricsParseError(f"{name} line is not UTF-8: {rest[:80]!r}") from exc
    labels: dict[str, str] = {}
    pos = 0
    text = line if line.startswith("{") else line.lstrip(" \t")  # tolerate "name {labels}"
    if text.startswith("{"):
        block = _LABEL_BLOCK_RE.match(text)
        if block is None:
            raise MetricsParseError(f"malformed label set in line: {_clip(name + line)!r}")
        inner = block.group(1)
        pairs = _LABEL_PAIR_RE.findall(inner)
        # Values without a backslash need no unescaping (the common case, and cheaper).
        labels = {k: _unescape(v) for k, v in pairs} if "\\" in inner else dict(pairs)
        pos = block.end()
    fields = text[pos:].split()
    if not 1 <= len(fields) <= 2:
        raise MetricsParseError(f"expected 'value [timestamp]' in line: {_clip(name + line)!r}")
    try:
        value = float(fields[0])
    except ValueError as exc:
        raise MetricsParseError(f"bad sample value in line: {_clip(name + line)!r}") from exc
    return PromSample(labels, value)


def _prefix_tree(names: Sequence[str]) -> str:
    """A regular expression matching exactly ``names``, factored as a prefix tree.

    Greedy optional groups (``...(?:_sum)?``) plus the scanner's following
    ``[{ \t]`` make a name that is a prefix of another still match exactly.
    """
    root: dict[str, Any] = {}
    for name in names:
        node = root
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a name

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        if len(branches) == 1 and "" not in node:
            return branches[0]
        return "(?:" + "|".join(branches) + ")" + ("?" if "" in node else "")

    return emit(root)


class PromScanner:
    """Finds the samples of a fixed set of sample names in a text exposition.

    One compiled regular expression matches a line start (``\\n``), one of the wanted
    names, and then ``{``, a space or a tab, so names that merely share a prefix
    (``vllm:num_requests_waiting_by_reason``) never match. Only matched lines are
    decoded and parsed; HELP/TYPE comments and other families are skipped at C speed.
    On the real 59 KB vLLM exposition this is ~50-100x cheaper than building all
    families with prometheus_client (bench/bench_parse.py).

    The names are compiled as a prefix tree (``vllm:(?:num_requests_(?:running|
    waiting)|...)``) rather than a flat alternation, so each line start is checked
    character by character once instead of once per wanted name: on that exposition
    adding the four decode-latency names cost ~3 us per scrape (bench/bench_parse.py).
    """

    __slots__ = ("_regex", "names")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        if not self.names or not all(self.names):
            raise ValueError("PromScanner needs at least one non-empty name")
        tree = _prefix_tree(self.names)
        self._regex = re.compile(("\n(" + tree + ")([{ \t][^\n]*)").encode("ascii"))

    def scan(self, body: bytes) -> dict[str, list[PromSample]]:
        """Samples of each wanted name (an absent name maps to an empty list).

        Raises :class:`MetricsParseError` for an empty body, a body without the final
        newline the text format requires (a truncated scrape), or a malformed wanted line.
        """
        if not body.strip():
            raise MetricsParseError("empty metrics body")
        if not body.endswith(b"\n"):
            raise MetricsParseError("exposition does not end with a newline (truncated body?)")
        found: dict[str, list[PromSample]] = {n: [] for n in self.names}
        for raw_name, rest in self._regex.findall(b"\n" + body):
            name = raw_name.decode("ascii")
            found[name].append(_parse_sample(name, rest))
        return found


def require_some(body: bytes, found: Mapping[str, Sequence[PromSample]], prefix: bytes) -> None:
    """Refuse a body that has none of the wanted families and no ``prefix`` series at all.

    Such a body is not this engine's exposition (a wrong port, a proxy error page), so
    the scrape must count as failed rather than as "nothing known".
    """
    if any(found.values()):
        return
    if b"\n" + prefix not in body and not body.startswith(prefix):
        head = body[:80].decode("utf-8", "replace")
        raise MetricsParseError(
            f"no {prefix.decode()}* series in the exposition (starts with {head!r})"
        )


def finite(value: float, what: str) -> float:
    """``value`` if finite; a NaN/Inf load figure is a parse error, never a number."""
    if not math.isfinite(value):
        raise MetricsParseError(f"{what} is not a finite number: {value!r}")
    return value


def nonneg_count(value: float | None, what: str) -> int | None:
    """A request or block count: None stays unknown, a negative value is an error."""
    if value is None:
        return None
    if value < 0:
        raise MetricsParseError(f"{what} is negative: {value!r}")
    return int(value)


def unit_fraction(value: float, what: str) -> float:
    """A finite fraction in [0, 1] (tiny float overshoot clamped), else an error."""
    finite(value, what)
    if not -1e-9 <= value <= 1.0 + 1e-9:
        raise MetricsParseError(f"{what} out of [0, 1]: {value!r}")
    return min(1.0, max(0.0, value))


def decode_pair(
    sums: Sequence[PromSample], counts: Sequence[PromSample], family: str
) -> tuple[float | None, float | None]:
    """A decode-latency histogram's ``_sum`` and ``_count``, summed over label sets.

    The pair feeds ``LoadSnapshot.decode_seconds_sum``/``decode_observations``: the
    ratio of two deltas is a mean latency. Half a pair (one without the other) gives
    no ratio, so both are then unknown; a negative or non-finite value is an error.
    """
    if not sums or not counts:
        return None, None
    total = sum(finite(s.value, family + "_sum") for s in sums)
    count = sum(finite(s.value, family + "_count") for s in counts)
    if total < 0 or count < 0:
        raise MetricsParseError(f"{family} _sum/_count is negative: {total!r}, {count!r}")
    return total, count


# --------------------------------------------------------------------------------------
# JSON metrics fields (TensorRT-LLM's iteration stats)
# --------------------------------------------------------------------------------------


def json_number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    """``obj[key]`` as a finite non-negative float; None when absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MetricsParseError(f"{where}.{key} is not a number: {value!r}")
    if not math.isfinite(value) or value < 0:
        raise MetricsParseError(f"{where}.{key} is not a finite non-negative number: {value!r}")
    return float(value)


def json_int(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    value = json_number(obj, key, where)
    return None if value is None else int(value)


def json_section(
    obj: Mapping[str, Any], key: str, where: str = "iteration stats"
) -> Mapping[str, Any]:
    """The object ``obj[key]``; an empty mapping when absent or null."""
    section = obj.get(key)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise MetricsParseError(f"{where} field {key} is not an object: {section!r}")
    return section


# --------------------------------------------------------------------------------------
# Shared helpers for priority, errors and launch validation (used by trtllm.py too)
# --------------------------------------------------------------------------------------


def spec_positive_int(settings: Mapping[str, Any], key: str) -> int | None:
    """``settings[key]`` when it is a positive integer (not a bool), else None: for raw
    InferenceService sections that may be of another API revision."""
    value = settings.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def clamp_level(level: int) -> int:
    """``level`` clamped into [LEVEL_MIN, LEVEL_MAX]; non-integers are a TypeError."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"priority level must be an int, got {type(level).__name__}")
    return max(LEVEL_MIN, min(LEVEL_MAX, level))


_MAX_MESSAGE = 256


def error_json(body: bytes) -> Any:
    """The decoded JSON of an error body, or None when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def text_message(body: bytes, status: int) -> str:
    """A short message from a non-JSON (or shapeless) error body."""
    text = body.decode("utf-8", "replace").strip()
    if not text:
        return f"HTTP {status}"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def check_error_status(status: int) -> None:
    """Only 4xx/5xx responses are errors to classify."""
    if not 400 <= status <= 599:
        raise EngineError(f"status {status} is not an HTTP error status (400-599)")


def validate_launch(launch: LaunchSpec, settings_type: type[BaseModel]) -> None:
    """Refuse a launch spec that no engine could start with, with a one-line reason."""
    if not launch.model_path.strip():
        raise EngineError("launch spec has an empty model_path")
    if not launch.served_model_name.strip():
        raise EngineError("launch spec has an empty served_model_name")
    if not 1 <= launch.port <= 65535:
        raise EngineError(f"port {launch.port} is outside 1-65535")
    if launch.tensor_parallel < 1 or launch.pipeline_parallel < 1:
        raise EngineError(
            f"parallelism must be >= 1 (tensor {launch.tensor_parallel}, "
            f"pipeline {launch.pipeline_parallel})"
        )
    if launch.settings is not None and not isinstance(launch.settings, settings_type):
        raise EngineError(
            f"settings are {type(launch.settings).__name__}, expected {settings_type.__name__}"
        )


# --------------------------------------------------------------------------------------
# Pieces of streamed token-event patterns (TokenEventShapes)
# --------------------------------------------------------------------------------------

#: A JSON string body (no quotes): no raw control characters, every escape complete.
SSE_JSON_STRING = rb'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*'
_SSE_INT = rb"(?:0|[1-9][0-9]{0,18})"
#: A non-empty JSON list of token ids.
SSE_TOKEN_IDS = rb"\[" + _SSE_INT + rb"(?:," + _SSE_INT + rb")*\]"


# --------------------------------------------------------------------------------------
# KV-event fields shared by the engines' decoders (each checks its own hash type)
# --------------------------------------------------------------------------------------


def kv_opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvEventsDecodeError(f"{what} must be an int, not {value!r}")
    return value


def kv_opt_text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventsDecodeError(f"{what} must be a string, not {value!r}")


def kv_hashes(value: Any, one: Callable[[Any, str], BlockHash]) -> tuple[BlockHash, ...]:
    """``block_hashes``: a list, each item checked by the engine's ``one``."""
    if not isinstance(value, list):
        raise KvEventsDecodeError(f"block_hashes must be a list, not {type(value).__name__}")
    return tuple(one(v, "block_hashes") for v in value)


def kv_removed_or_cleared(
    kind: Any, raw: Mapping[str, Any], one: Callable[[Any, str], BlockHash]
) -> BlockRemoved | AllBlocksCleared:
    """The map-shaped ``BlockRemoved`` / ``AllBlocksCleared`` events (the same fields in
    vLLM's and TensorRT-LLM's streams); anything else is undecodable."""
    try:
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=kv_hashes(raw["block_hashes"], one),
                medium=kv_opt_text(raw.get("medium"), "medium"),
                group=kv_opt_int(raw.get("group_idx"), "group_idx"),
            )
    except KeyError as e:
        raise KvEventsDecodeError(f"{kind} event without field {e.args[0]!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventsDecodeError(f"unknown KV event type {kind!r}")
