"""hack/make-tiny-model.py is reproducible: a fresh build equals the cached model byte for byte.

The real-vLLM checks are only comparable across runs and machines if the model
they serve is always the same; the script builds it from fixed seeds, offline.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from realvllm import REPO, ensure_model, ensure_venv, offline_env

pytestmark = [pytest.mark.realvllm, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_tiny_model_rebuild_is_byte_identical(tmp_path: Path) -> None:
    python = ensure_venv()
    cached = ensure_model(python)
    fresh = tmp_path / "tiny-llama"
    proc = subprocess.run(
        [str(python), str(REPO / "hack" / "make-tiny-model.py"), "--out", str(fresh), "--digest"],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in cached.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    for name in names:
        assert (cached / name).read_bytes() == (fresh / name).read_bytes(), name
    config = json.loads((fresh / "config.json").read_text())
    expected: dict[str, object] = {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    expected |= {"head_dim": 32, "num_key_value_heads": 4, "intermediate_size": 256}
    expected |= {"vocab_size": 2048, "dtype": "float32"}
    assert {k: config[k] for k in expected} == expected
    tok_config = json.loads((fresh / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<s>", "</s>")
    assert (tok_config["unk_token"], tok_config["pad_token"]) == ("<unk>", "<pad>")
    assert "add_generation_prompt" in (fresh / "chat_template.jinja").read_text()
