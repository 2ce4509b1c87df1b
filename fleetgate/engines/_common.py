"""Engine-neutral helpers shared by the adapters: a minimal, fast Prometheus
text scanner, numeric and error-body checks, and launch validation.

Private (underscore) so the registry never mistakes it for an engine module.
Pure: standard library and pydantic only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from fleetgate.engines.base import (
    LEVEL_MAX,
    LEVEL_MIN,
    EngineError,
    LaunchSpec,
    MetricsParseError,
)

# --------------------------------------------------------------------------------------
# A minimal Prometheus text-format scanner
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PromSample:
    """One sample line of a wanted family: its labels by name, and its value."""

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
        labels = {k: _unescape(v) for k, v in _LABEL_PAIR_RE.findall(block.group(1))}
        pos = block.end()
    fields = text[pos:].split()
    if not 1 <= len(fields) <= 2:
        raise MetricsParseError(f"expected 'value [timestamp]' in line: {_clip(name + line)!r}")
    try:
        value = float(fields[0])
    except ValueError as exc:
        raise MetricsParseError(f"bad sample value in line: {_clip(name + line)!r}") from exc
    return PromSample(labels, value)


class PromScanner:
    """Finds the samples of a fixed set of sample names in a text exposition.

    One compiled regular expression matches a line start (``\\n``), one of the wanted
    names, and then ``{``, a space or a tab, so names that merely share a prefix
    (``vllm:num_requests_waiting_by_reason``) never match. Only matched lines are
    decoded and parsed; HELP/TYPE comments and other families are skipped at C speed.
    On the real 59 KB vLLM exposition this is ~50-100x cheaper than building all
    families with prometheus_client (bench/bench_parse.py).
    """

    __slots__ = ("_regex", "names")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        alternatives = "|".join(re.escape(n) for n in sorted(self.names, key=len, reverse=True))
        self._regex = re.compile(("\n(" + alternatives + ")([{ \t][^\n]*)").encode("ascii"))

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


# --------------------------------------------------------------------------------------
# Shared helpers for priority, errors and launch validation (used by trtllm.py too)
# --------------------------------------------------------------------------------------


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
