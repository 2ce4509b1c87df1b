"""A LoRA adapter for the tiny test model, written in PEFT's on-disk format with the
standard library only (no torch in the test venv): ``adapter_config.json`` and
``adapter_model.safetensors`` (an 8-byte little-endian header length, the JSON header,
the raw little-endian float32 tensors). Rank 8 on ``q_proj`` and ``v_proj`` of every
layer, small random weights from a fixed seed: what it generates does not matter,
only that vLLM serves it as an adapter.
"""

from __future__ import annotations

import array
import json
import random
import struct
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "v_proj")


def write_adapter(out: Path, model: Path, *, seed: int = 7) -> Path:
    """Write the adapter for the model in ``model`` (its ``config.json`` gives the
    sizes) into ``out``; returns ``out``."""
    config = json.loads((model / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    out_dims = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    rng = random.Random(seed)
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for layer in range(layers):
        for proj in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            for part, shape in (("lora_A", [RANK, hidden]), ("lora_B", [out_dims[proj], RANK])):
                n = shape[0] * shape[1]
                data = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(n)))
                if struct.pack("=f", 1.0) != struct.pack("<f", 1.0):
                    data.byteswap()  # safetensors is little-endian
                raw = data.tobytes()
                header[f"{name}.{part}.weight"] = {
                    "dtype": "F32",
                    "shape": shape,
                    "data_offsets": [offset, offset + len(raw)],
                }
                blobs.append(raw)
                offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(head)) + head + b"".join(blobs)
    )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(model),
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out
