"""FP8 draft weights: per-output-channel float8_e4m3fn with fp32 scales, in compressed-tensors format.

Which format: vLLM 0.32 has two FP8 checkpoint paths. Its own ``"fp8"`` method
(``quantization/fp8.py``) reads one scale per tensor (per logical shard of q/k/v, gate/up) or
per block (``weight_scale_inv``), not per channel. compressed-tensors ``float-quantized`` with
``strategy: "channel"`` weights (``quantization/compressed_tensors``, scheme
``CompressedTensorsW8A8Fp8``) reads a ``[out, 1]`` ``weight_scale`` per linear, the layout
llm-compressor's ``FP8_DYNAMIC`` preset writes. So this module writes that: for every quantised
linear ``X``, ``X.weight`` (float8_e4m3fn) and ``X.weight_scale`` (float32 ``[out, 1]``), and a
``quantization_config`` whose activations are dynamic per-token FP8 (nothing to calibrate).

Numerics (what the tests bound): ``scale = amax(|row|) / 448`` (448 = e4m3fn's largest finite),
``q = round_to_nearest_even(w / scale)``; the row maximum maps to 448 exactly (a row whose
``amax / 448`` is 0, zero or under ~6e-43, gets scale 1 and codes 0, as compressed-tensors gives it
eps). e4m3fn has 3 mantissa bits, so for normal values ``|w - q * scale| <= 2**-4 * |w|``; below 2**-6 (subnormals)
the spacing is 2**-9, so the error is at most ``2**-10 * scale`` there. torch's cast to
float8_e4m3fn does not saturate (out of range becomes NaN), hence the clamp.

Quantised: ``fc`` and the midlayer's q/k/v/o and gate/up/down projections (vLLM's
``LinearBase`` layers of the draft). Not quantised, kept at the export dtype: norms, ``d2t``/``t2d``
and ``lm_head``. ``lm_head`` picks the draft token by argmax, so its rounding flips near ties
directly, and FP8 ``lm_head`` is outside what compressed-tensors' FP8 presets produce
(``ignore: ["lm_head"]``, as llm-compressor's FP8 recipes write it).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Draft linears quantised, by name suffix of their weight in the exported checkpoint.
LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Left in high precision (see module docstring); names as in the exported checkpoint.
IGNORE = ("lm_head",)


def is_quantised_linear(name: str) -> bool:
    """``True`` for ``<linear>.weight`` of a layer in :data:`LINEARS` (``fc.weight``, ``midlayer.*_proj.weight``)."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    return module.rsplit(".", 1)[-1] in LINEARS and not module.startswith(IGNORE)


def quantise_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` float8_e4m3fn like ``weight``, ``scale`` float32 ``[out, 1]``."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    # A zero row, or one whose amax / 448 underflows float32 (amax below ~6e-43), keeps a positive scale
    # (its codes are all 0): dividing by a zero scale would make its codes 0 / 0 = NaN.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantise_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of an exported draft state with every quantised linear as ``weight`` + ``weight_scale``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_quantised_linear(name) and t.is_floating_point():
            q, scale = quantise_per_channel(t)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale"] = scale
        else:
            out[name] = t
    return out


def dequantise_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inverse layout of :func:`quantise_state`: plain ``weight`` tensors (``q * scale``) in ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale") if name.endswith(".weight") else None
        out[name] = dequantise(t, scale, dtype) if scale is not None else t
    return out


def is_fp8_state(tensors: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(".weight_scale") for name in tensors)


def quantization_config() -> dict:
    """The ``quantization_config`` of config.json, as vLLM's ``CompressedTensorsConfig.from_config`` reads it."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True, "observer": None},
            },
        },
        "ignore": list(IGNORE),
    }
