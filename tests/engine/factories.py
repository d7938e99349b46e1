"""Shared builders for engine tests: prompts and an engine on a test model."""

from __future__ import annotations

from loramux.engine import Engine, EngineConfig

PROMPTS = [
    "Hello there, how are you today?",
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):\n    ",
    "List three colours:",
    "Translate to German: good morning",
    "The quick brown fox",
    "In 1969, the first person to walk on the moon was",
]


def build_engine(model_dir, adapters=None, **overrides) -> Engine:
    """An fp32 engine on ``model_dir`` with ``adapters`` (name -> PEFT dir) loaded."""
    config = {
        "model": str(model_dir),
        "kv_cache_bytes": 16 << 20,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "dtype": "float32",
        **overrides,
    }
    engine = Engine(EngineConfig(**config))
    for name, path in (adapters or {}).items():
        engine.add_adapter(name, path)
    return engine
