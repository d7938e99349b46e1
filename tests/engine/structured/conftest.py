"""The structured-output tests' compiler: SmolLM2's tokenizer, built once per run."""

from __future__ import annotations

import pytest

from loramux.engine.structured import GrammarCompiler


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id]
    )
