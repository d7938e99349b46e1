"""transformers + PEFT as the independent reference: greedy decoding, one request alone."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def _load(model_dir: str, adapter_dir: str | None, dtype: torch.dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def reference_model(model_dir: Path, adapter_dir: Path | None, dtype=torch.float32):
    return _load(str(model_dir), None if adapter_dir is None else str(adapter_dir), dtype)


@cache
def _load_mix(model_dir: str, parts: tuple[tuple[str, float], ...], dtype: torch.dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    names = [f"part{i}" for i in range(len(parts))]
    model = PeftModel.from_pretrained(model, parts[0][0], adapter_name=names[0])
    for name, (adapter_dir, _) in zip(names[1:], parts[1:], strict=True):
        model.load_adapter(adapter_dir, adapter_name=name)
    weights = [weight for _, weight in parts]
    model.add_weighted_adapter(names, weights, "mix", combination_type="cat")
    model.set_adapter("mix")
    return model.eval()


def mixed_reference_model(model_dir: Path, parts, dtype=torch.float32):
    """transformers + PEFT with ``parts`` ((adapter dir, weight), ...) combined by
    ``add_weighted_adapter(..., combination_type="cat")``: the weighted sum of their deltas."""
    key = tuple((str(adapter_dir), float(weight)) for adapter_dir, weight in parts)
    return _load_mix(str(model_dir), key, dtype)


def fake_quantized_cache(kv_cache_dtype: str):
    """transformers' own KV cache, storing each new key and value as an engine with
    ``kv_cache_dtype`` reads it back (``kernels/kv_quant.fake_quantize_kv``: per token and
    KV head, after RoPE); None for ``auto`` (the model's default cache)."""
    if kv_cache_dtype == "auto":
        return None
    from transformers import DynamicCache

    from loramux.kernels.kv_quant import fake_quantize_kv

    class FakeQuantizedCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # [batch, kv_heads, new tokens, head_dim]: the maths is per last-dim vector.
            key_states = fake_quantize_kv(key_states, kv_cache_dtype)
            value_states = fake_quantize_kv(value_states, kv_cache_dtype)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return FakeQuantizedCache()


@torch.inference_mode()
def greedy_tokens(
    model_dir: Path,
    adapter_dir: Path | None,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    eos_ids: frozenset[int] = frozenset(),
    dtype=torch.float32,
    kv_cache_dtype: str = "auto",
    mix=None,
) -> list[int]:
    """Greedy tokens for one request run alone, with transformers' own KV cache (holding
    what an engine's quantized cache would for ``kv_cache_dtype``); with ``mix`` ((adapter
    dir, weight), ...), on PEFT's weighted combination of those adapters instead."""
    if mix is not None:
        model = mixed_reference_model(model_dir, mix, dtype)
    else:
        model = reference_model(model_dir, adapter_dir, dtype)
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True, past_key_values=fake_quantized_cache(kv_cache_dtype))
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos_ids or len(tokens) >= max_tokens:
            return tokens
        out = model(
            input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
        )


@torch.inference_mode()
def first_step_logits(
    model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], dtype=torch.float32
) -> torch.Tensor:
    model = reference_model(model_dir, adapter_dir, dtype)
    return model(input_ids=torch.tensor([prompt_ids])).logits[0, -1]
