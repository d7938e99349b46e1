"""Adapters for the ingest tests: a good one for the tiny model, one for a narrower base."""

from __future__ import annotations

from pathlib import Path

import pytest

from loramux.engine.model.config import ModelConfig
from tests.fixtures.models import build_tiny_model

GOOD_RANK = 8
GOOD_TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="session")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def good_adapter(make_adapter, tiny_model_dir) -> Path:
    """A real PEFT adapter (rank 8 on q_proj and v_proj) for the tiny model."""
    return make_adapter(tiny_model_dir, rank=GOOD_RANK, targets=GOOD_TARGETS, seed=1)


@pytest.fixture(scope="session")
def narrow_base_adapter(make_adapter, tmp_path_factory, tokenizer_dir) -> Path:
    """A real PEFT adapter built on a hidden-32 model: the wrong shapes for the tiny one."""
    narrow = build_tiny_model(
        tmp_path_factory.mktemp("narrow-llama"), tokenizer_dir, hidden_size=32
    )
    return make_adapter(narrow, rank=4, targets=GOOD_TARGETS, seed=2)
