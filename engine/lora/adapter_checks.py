"""The checks a PEFT adapter's tensors go through as they are read (``adapter.py``):
shapes against the base model, values finite in the serving dtype (scaled B included),
and DoRA's magnitudes and LoRA biases agreeing with ``adapter_config.json``. Each failure
is an ``AdapterError`` naming the tensor."""

from __future__ import annotations

import math

import torch

from loramux.engine.lora.adapter_config import CONFIG_FILE, AdapterConfig, AdapterError


def check_shapes(key: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int]) -> int:
    """The rank of a layer's A [r, in] and B [out, r], after checking both against the base."""
    in_features, out_features = shape
    if a.ndim != 2 or a.shape[1] != in_features or a.shape[0] < 1:
        raise AdapterError(
            f"{key}.lora_A has shape {tuple(a.shape)}; the base model needs [r, {in_features}]"
        )
    rank = a.shape[0]
    if b.ndim != 2 or tuple(b.shape) != (out_features, rank):
        raise AdapterError(
            f"{key}.lora_B has shape {tuple(b.shape)}; the base model needs "
            f"[{out_features}, {rank}]"
        )
    return rank


def _per_output(
    raw, enabled: bool, which: str, key: str, module: str, layer: int, out_features: int
) -> torch.Tensor | None:
    """A module's layer's per-output tensor of kind ``which`` ([out]), None unless the
    config ``enabled`` it; an error naming the tensor when the config and the file disagree.
    """
    tensor, flag, what = {
        "M": ("lora_magnitude_vector", "use_dora", "a DoRA tensor"),
        "bias": ("lora_B.bias", "lora_bias", "a LoRA bias"),
    }[which]
    entry = raw.get((module, layer, which))
    if not enabled:
        if entry is not None:
            raise AdapterError(
                f"{key}.{tensor} is {what}, but {CONFIG_FILE} does not say {flag}: true; "
                "save the adapter with the config PEFT wrote for it"
            )
        return None
    if entry is None:
        raise AdapterError(
            f"{key} has no {tensor}, which an adapter with {flag}: true needs for every "
            "module it targets"
        )
    value = entry[1]
    if value.ndim != 1 or value.shape[0] != out_features:
        raise AdapterError(
            f"{key}.{tensor} has shape {tuple(value.shape)}; the base model needs [{out_features}]"
        )
    return value


def magnitude_of(
    raw, config: AdapterConfig, key: str, module: str, layer: int, out_features: int, dtype
) -> torch.Tensor | None:
    """DoRA's magnitude vector of a module's layer ([out], finite in ``dtype``), None
    without ``use_dora``."""
    magnitude = _per_output(raw, config.use_dora, "M", key, module, layer, out_features)
    if magnitude is not None and not fits(float(magnitude.abs().max()), dtype):
        raise AdapterError(
            f"{key}.lora_magnitude_vector holds NaN, infinite or values beyond "
            f"{str(dtype).removeprefix('torch.')}'s range"
        )
    return magnitude


def lora_bias_of(
    raw, config: AdapterConfig, key: str, module: str, layer: int, out_features: int
) -> torch.Tensor | None:
    """lora_B's bias of a module's layer ([out]), None without ``lora_bias`` (its values
    are checked with B's)."""
    return _per_output(raw, config.lora_bias, "bias", key, module, layer, out_features)


def fits(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` stays finite when rounded to ``dtype``."""
    return math.isfinite(value) and bool(
        torch.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype))
    )


def check_values(key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype) -> None:
    """A and B must be finite, and A, B, the scale and scale·B finite in ``dtype``.

    The engine keeps scales in the serving dtype and multiplies B by them: a value that
    overflows there turns the adapter's outputs into inf/NaN (or makes the step raise).
    Rounding is monotonic, so a tensor fits ``dtype`` when its largest magnitude does: one
    reduction per tensor (NaN and inf propagate through it) instead of a check per element
    kind, since the loader thread runs beside the engine's steps and a load's cost is felt
    there.
    """
    peak_a, peak_b = float(a.abs().max()), float(b.abs().max())
    if not (math.isfinite(peak_a) and math.isfinite(peak_b)):
        raise AdapterError(f"{key} holds NaN or infinite values")
    peak = peak_b * abs(scale)
    if fits(max(peak_a, peak_b, abs(scale), peak), dtype):
        return
    dtype_name, largest = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
    beyond = f"beyond {dtype_name}'s largest value ({largest:g}), the dtype it is served in"
    for which, value in (("A", peak_a), ("B", peak_b)):
        if not fits(value, dtype):
            raise AdapterError(f"{key}.lora_{which} has values {beyond}")
    if not fits(scale, dtype):
        raise AdapterError(f"{key}: its scale (lora_alpha/r = {scale:g}) is {beyond}")
    raise AdapterError(
        f"{key}: lora_B times its scale (lora_alpha/r = {scale:g}) reaches {peak:.4g}, "
        f"{beyond}; lower lora_alpha or the weights"
    )
