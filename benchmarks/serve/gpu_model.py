"""What the GPU runner serves: a model folder without weights, random adapters, and the
transformers + PEFT baseline built on the same random weights.

* Model folders (``random_model_dir``): ``config.json`` (Llama-7B's shape, or a tiny one
  for the CPU smoke) and the tokenizer files copied from the SmolLM2 folder (its ids
  below 32,000 decode fine); the engine runs them with ``load_format="random"``.
* Adapters (``random_adapter_state``, drawn by ``adapters.lora_tensors``): PEFT LoRA
  tensors on q/k/v/o (S-LoRA's setting) made on the host from ``(seed, index)`` alone,
  A ~ N(0, 1/in), B ~ N(0, 0.02²), ``lora_alpha = 2r``: a delta of 10-25% of a 7B
  projection's output, large enough at the smoke's tiny shapes to change greedy tokens.
  The engine fetches them through a ``CallableSource`` that writes the two PEFT files
  (``random_adapter_source``), paying what a store fetch costs; the baseline gets the
  tensors.
* Baseline model (``baseline_model``): transformers' ``LlamaForCausalLM`` filled by the
  engine's own ``fill_random_`` with the engine's seed: both systems hold the same weights.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from loramux.benchmarks.common.adapters import QKVO, adapter_config, lora_tensors, write_adapter
from loramux.benchmarks.common.files import publish_folder

LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# The CPU smoke: the same code at shapes that run in seconds.
SMOKE_MODEL = {
    **LLAMA_7B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "torch_dtype": "float32",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
WARM_ADAPTER = "warm"  # the PeftModel's first adapter, before any of the workload's


def random_model_dir(folder: Path, hf_config: dict, tokenizer_source) -> Path:
    """``folder`` holding ``hf_config`` as config.json and a tokenizer; made once.

    ``tokenizer_source()`` returns the folder to copy the tokenizer files from; it is
    called only when ``folder`` is missing or holds another config.
    """
    config_text = json.dumps(hf_config, indent=2) + "\n"

    def made() -> bool:
        config_path = folder / "config.json"
        return (
            config_path.is_file()
            and config_path.read_text() == config_text
            and (folder / "tokenizer.json").is_file()
        )

    if made():
        return folder
    source = Path(tokenizer_source())
    staging = folder.with_name(f"{folder.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, staging / name)
        (staging / "config.json").write_text(config_text)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_folder(staging, folder, made)
    return folder


def random_adapter_state(
    model_config, rank: int, *, seed: int, index: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors of adapter ``index`` on q/k/v/o, one generator per adapter."""
    return lora_tensors(
        model_config, rank, QKVO, seed=seed * 1_000_003 + index, a_std=None, dtype=dtype
    )


def random_adapter_source(model_config, rank: int, *, seed: int, index: int, dtype: torch.dtype):
    """A ``CallableSource`` whose fetch writes adapter ``index``'s two PEFT files."""
    from loramux.engine.lora.source import CallableSource

    def fetch(dest: Path) -> None:
        state = random_adapter_state(model_config, rank, seed=seed, index=index, dtype=dtype)
        write_adapter(dest, state, adapter_config(rank, QKVO))

    return CallableSource(fetch, description=f"random adapter {index} (rank {rank}, seed {seed})")


def lora_config(rank: int):
    """PEFT's ``LoraConfig`` for ``adapters.adapter_config`` on q/k/v/o."""
    from peft import LoraConfig

    raw = adapter_config(rank, QKVO)
    fields = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias")
    return LoraConfig(**{name: raw[name] for name in fields})


def baseline_model(model_dir: Path, *, seed: int, dtype: torch.dtype, device: str, warm_rank: int):
    """transformers' Llama on ``device`` in ``dtype`` holding the engine's random weights
    for ``seed``, as a ``PeftModel`` whose only adapter is ``WARM_ADAPTER``."""
    from peft import get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM

    from loramux.engine.model.loader import fill_random_

    hf_config = AutoConfig.from_pretrained(model_dir)
    # Allocated on the device in the dtype from the start (transformers' own init runs
    # there too, then is overwritten); never a host or float32 copy of the weights.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            base = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    fill_random_(base, seed=seed)
    model = get_peft_model(
        base, lora_config(warm_rank), adapter_name=WARM_ADAPTER, autocast_adapter_dtype=False
    )
    return model.eval()
