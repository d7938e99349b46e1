"""A PEFT LoRA adapter as llama.cpp's GGUF LoRA file, for llama.cpp to serve the same
adapters the engine does.

What llama.cpp's ``convert_lora_to_gguf.py`` (vendor/llama.cpp in llama-cpp-python 0.3.36)
writes for a Llama adapter, and what its loader (``src/llama-adapter.cpp``) checks:

* metadata ``general.architecture`` = ``llama`` (the base model's), ``general.type`` =
  ``adapter``, ``adapter.type`` = ``lora``, ``adapter.lora.alpha`` (float32: PEFT's
  ``lora_alpha``; llama.cpp scales each delta by alpha / rank, as PEFT does);
* per targeted projection two tensors named after the base tensor, ``blk.N.attn_q.weight``
  + ``.lora_a`` / ``.lora_b`` (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
  ffn_down), each in F32 here: A with GGUF dimensions ``[in, rank]`` (``ne0`` first: numpy
  ``(rank, in)``, PEFT's ``lora_A`` as it is) and B ``[rank, out]`` (numpy ``(out, rank)``,
  PEFT's ``lora_B``);
* B of q and k with its rows in llama.cpp's RoPE order: the converter permutes the base
  q/k weights' rows (its RoPE rotates adjacent pairs, HF's the two halves of each head)
  and applies the same permutation to B's rows (``LoraTorchTensor.permute`` acts on B when
  the row dimension moves); without it a q/k delta would land on the wrong features.

The file is written with gguf-py's ``GGUFWriter`` (GGUF version 3), the writer llama.cpp's
converter uses, which loramux already depends on for its own GGUF work.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import numpy as np

from loramux.benchmarks.common.models import model_key

# llama.cpp's name of each projection PEFT targets (convert_hf_to_gguf's tensor map).
LLAMA_CPP_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
_PEFT_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


def rope_permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """``rows`` (HF's q or k output rows first) in llama.cpp's order: within each head, HF's
    two rotary halves ``[2, D/2]`` stored transposed as ``[D/2, 2]`` (adjacent pairs); the
    converter's ``LlamaModel.permute``."""
    count = rows.shape[0]
    if count % (2 * heads):
        raise ValueError(f"{count} rows do not split into {heads} heads of even size")
    halves = rows.reshape(heads, 2, count // heads // 2, *rows.shape[1:])
    return halves.swapaxes(1, 2).reshape(rows.shape)


def lora_tensors_for_llama_cpp(
    tensors: dict[str, np.ndarray], model_config
) -> list[tuple[str, np.ndarray]]:
    """PEFT's ``lora_A`` / ``lora_B`` tensors under llama.cpp's names, in float32, B of q and
    k in RoPE order; by layer, then module in the model's order, A before B."""
    order = list(LLAMA_CPP_NAMES)
    found = []
    for name, array in tensors.items():
        match = _PEFT_NAME.fullmatch(name)
        if match is None or match[2] not in LLAMA_CPP_NAMES:
            raise ValueError(f"{name}: not a LoRA tensor of a Llama projection llama.cpp takes")
        layer, module, part = int(match[1]), match[2], match[3]
        array = np.ascontiguousarray(array, dtype=np.float32)
        if part == "B" and module in ("q_proj", "k_proj"):
            heads = model_config.num_heads if module == "q_proj" else model_config.num_kv_heads
            array = rope_permute_rows(array, heads)
        gguf_name = f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.weight.lora_{part.lower()}"
        found.append(((layer, order.index(module), part), gguf_name, array))
    return [(name, array) for _, name, array in sorted(found, key=lambda item: item[0])]


def write_gguf_lora(adapter_dir: Path, model_config, dest: Path) -> Path:
    """The PEFT adapter in ``adapter_dir`` as a GGUF LoRA file ``dest`` (written whole or
    not at all)."""
    import gguf
    from safetensors.numpy import load_file

    from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE

    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: rsLoRA and per-module ranks or alphas are not written")
    tensors = lora_tensors_for_llama_cpp(load_file(adapter_dir / WEIGHTS_FILE), model_config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(f"{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    writer = gguf.GGUFWriter(str(staging), arch="llama")  # general.architecture
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)  # general.type = "adapter"
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
        for name, array in tensors:
            writer.add_tensor(name, array)  # F32; GGUF lists numpy's shape reversed
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    staging.replace(dest)
    return dest


def cached_gguf_lora(cache_dir: Path, model_dir: Path, adapter_dir: Path, model_config) -> Path:
    """The GGUF LoRA file of the cached PEFT adapter ``adapter_dir`` (whose folder name says
    everything that decides its contents), written on first use."""
    dest = cache_dir / "gguf-lora" / model_key(model_dir) / f"{adapter_dir.name}.gguf"
    return dest if dest.is_file() else write_gguf_lora(adapter_dir, model_config, dest)
