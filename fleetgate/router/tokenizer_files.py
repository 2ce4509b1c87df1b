"""Build each model's :class:`~fleetgate.router.scheduling.tokenize.Tokenizer` from the
router config (``scheduling.tokenizers``): the one place tokenizer files are read.

``kind: hf`` reads ``<path>/tokenizer.json``, ``<path>/tokenizer_config.json`` (special
tokens, and the chat template when it holds one) and ``<path>/chat_template.jinja``
(the template otherwise). ``kind: emulator`` is ``kind: hf`` over the emulator's
tokenizer files shipped in the package (:data:`EMULATOR_TOKENIZER_DIR`, written by
``fleetgate sim --write-tokenizer``): one code path for emulated and real engines.
A missing or unreadable file is a :class:`ConfigError` at start-up, never a
per-request failure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import fleetgate
from fleetgate.router.config import ConfigError, TokenizerSpec
from fleetgate.router.scheduling.tokenize import HfTokenizer, Tokenizer, chat_template_of

#: the emulator's tokenizer in Hugging Face format (package data; a path, no import)
EMULATOR_TOKENIZER_DIR = Path(fleetgate.__file__).parent / "sim" / "emulator-tokenizer"


def load_tokenizer(model: str, spec: TokenizerSpec) -> Tokenizer:
    if spec.kind == "emulator":
        root = EMULATOR_TOKENIZER_DIR
    elif spec.path is None:
        raise ConfigError(f"scheduling.tokenizers.{model}: kind hf needs a path")
    else:
        root = Path(spec.path)
    tok_file = root / "tokenizer.json"
    try:
        tokenizer_json = tok_file.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"scheduling.tokenizers.{model}: cannot read {tok_file}: {e}") from None
    config: dict[str, object] = {}
    cfg_file = root / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"scheduling.tokenizers.{model}: bad {cfg_file}: {e}") from None
        if isinstance(loaded, dict):
            config = loaded
    jinja_file = root / "chat_template.jinja"
    template_file = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
    try:
        return HfTokenizer(tokenizer_json, config, chat_template_of(config, template_file))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ConfigError(f"scheduling.tokenizers.{model}: {root}: {e}") from None


def load_tokenizers(specs: Mapping[str, TokenizerSpec]) -> dict[str, Tokenizer]:
    """Every configured model's tokenizer (built once, at app start)."""
    return {model: load_tokenizer(model, spec) for model, spec in specs.items()}
