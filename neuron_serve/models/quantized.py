"""8-bit copies of a float checkpoint, in the formats vLLM loads, built offline.

    dequantized = write_quantized(src, dst, "int8-w8a16")

Formats (FORMATS): vLLM's own `fp8` (per-tensor scales), compressed-tensors FP8
(per-channel or per-tensor, declaring dynamic FP8 activations) and compressed-tensors
INT8 weight-only (W8A16, `pack-quantized`, a scale per output channel). The decoder's
linear layers are quantized; embeddings, the LM head and norms stay as they were, as the
usual quantization recipes leave them.

`kv_scales` adds vLLM's per-tensor KV-cache scales (`self_attn.k_scale`, `v_scale` of each
layer), which a `--kv-cache-dtype fp8` engine reads in place of 1.0.

The returned state dict holds the quantized layers' weights as a loader reads them back
(dequantized, float32): the oracle that Transformers runs for parity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FORMATS = ("fp8", "fp8-channel", "fp8-tensor", "int8-w8a16")
_FP8_MAX = torch.finfo(FP8).max

_COMPRESSED_FP8 = {  # compressed-tensors' scheme: FP8 weights, dynamic FP8 activations
    "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_DYNAMIC_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                   "dynamic": True}


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("_proj.weight") and tensor.dim() == 2


def _fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax / _FP8_MAX).clamp(min=1e-12).float()
    return (weight / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), scale


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12).float()
    return (weight / scale).round().clamp(-127, 127).to(torch.int8), scale


def _pack_int8(values: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 → [N, K / 4] int32, compressed-tensors' `pack-quantized`: each value + 128
    as a byte, the lowest byte the lowest k."""
    unsigned = (values.to(torch.int32) + 128).view(values.shape[0], -1, 4)
    packed = sum(unsigned[..., i] << (8 * i) for i in range(4))
    return packed.to(torch.int32)


def _quantization_config(fmt: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if fmt == "int8-w8a16":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                   "dynamic": False, "group_size": None}
        scheme, form = {"targets": ["Linear"], "weights": weights}, "pack-quantized"
    else:
        strategy = "channel" if fmt == "fp8-channel" else "tensor"
        scheme = {"targets": ["Linear"], "weights": {**_COMPRESSED_FP8, "strategy": strategy},
                  "input_activations": _DYNAMIC_TOKENS}
        form = "float-quantized"
    return {"quant_method": "compressed-tensors", "format": form,
            "quantization_status": "compressed", "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"]}


def write_quantized(src: Path | str, dst: Path | str, fmt: str,
                    kv_scales: tuple[float, float] | None = None) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with its decoder linear layers in format `fmt` (and
    `kv_scales`, (k, v), in every layer); returns their dequantized weights by name (see
    the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {FORMATS}")
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors, dequantized = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not _quantized(name, tensor):
            tensors[name] = tensor
            continue
        base = name.removesuffix(".weight")
        weight = tensor.float()
        if fmt == "int8-w8a16":
            values, scale = _int8(weight)
            tensors[f"{base}.weight_packed"] = _pack_int8(values)
            tensors[f"{base}.weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
            tensors[f"{base}.weight_scale"] = scale
        else:
            values, scale = _fp8(weight, per_channel=fmt == "fp8-channel")
            tensors[name] = values
            tensors[f"{base}.weight_scale"] = scale.reshape(-1, 1) if scale.dim() else scale.reshape(1)
        dequantized[name] = values.float() * scale
        if kv_scales and name.endswith("self_attn.k_proj.weight"):
            attn = name.removesuffix("k_proj.weight")
            for kind, value in zip("kv", kv_scales):
                tensors[f"{attn}{kind}_scale"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dequantized
