"""Shared builders for engine tests: prompts and an engine on a test model."""

from __future__ import annotations

import math

from loramux.engine import Engine, EngineConfig
from loramux.engine.model.config import ModelConfig

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


# The draft length's cost of a proposed token in the tests' engines: fixed, so whether a
# test's requests speculate does not depend on how fast this machine runs its steps
# (engine/speculative/step_cost.py measures it otherwise; its own tests check that).
TEST_PROPOSAL_COST = 0.1


# No prefill step target: the prompt budget is max_num_batched_tokens, whatever the machine's
# load, for tests whose scheduling must not depend on time.
UNTIMED_PREFILL_S = math.inf


def build_engine(
    model_dir, adapters=None, *, proposal_cost: float | None = TEST_PROPOSAL_COST, **overrides
) -> Engine:
    """An fp32 engine on ``model_dir`` with ``adapters`` (name -> PEFT dir) loaded; with
    speculation, its proposals cost ``proposal_cost`` (None: measured, as in serving)."""
    config = {
        "model": str(model_dir),
        "kv_cache_bytes": 16 << 20,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "dtype": "float32",
        **overrides,
    }
    engine = Engine(EngineConfig(**config))
    if engine.speculator is not None:
        engine.speculator.fixed_cost = proposal_cost
    for name, path in (adapters or {}).items():
        engine.add_adapter(name, path)
    return engine


def put_adapters_on_device(engine: Engine, names) -> None:
    """Make ``names`` device-resident (idle) with a one-token request each.

    Adapters are staged only into memory no request was promised (``lora/staging.py``),
    so requests arriving with their adapters cold wait rather than crowd KV. The tests that
    need preemption by recompute put them on the device first: KV is then left its floor,
    and the requests admitted into it (optimistically, as always) outgrow it."""
    from loramux.engine import SamplingParams

    engine.generate(["warm"] * len(names), SamplingParams(max_tokens=1), adapters=list(names))
    assert all(engine.adapter_residency()[name] == "device" for name in names)


# A model whose adapter rows line up with nothing: Σ in_features over the seven LoRA targets
# is 184, Σ out is 168, a KV block of one 8-wide head is 8 elements per token.
ODD_ROWS_CONFIG = ModelConfig(
    vocab_size=32,
    hidden_size=24,
    intermediate_size=40,
    num_layers=2,
    num_heads=3,
    num_kv_heads=1,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
