"""The suite's second real model: Gemma 3 270M in Q4_K_M, served from its own GGUF.

Another family than SmolLM2 (scaled embeddings, Gemma's norms, local and global layers,
a vocabulary of 262,144) and other GGML types (Q5_0, Q6_K besides Q4_K and Q8_0), read
natively. The reference is transformers on the same file, which de-quantizes every tensor
to float32: the engine, computing with the packed weights, must give its greedy tokens for
16 prompts and its perplexity on a text of this test's own within 1%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.kernels.quant_linear import QuantizedWeight

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The three primary colors are",
    "Water boils at",
    "A haiku about the sea:",
    "import numpy as np\n",
    "The largest planet in the solar system is",
    "Translate to French: good morning",
    "1, 2, 3, 4,",
    "The opposite of hot is",
    "In 1969, astronauts",
    "Photosynthesis is the process by which",
    "My favourite breakfast is",
    "SELECT name FROM",
    "The quick brown fox",
]
MAX_TOKENS = 8
TEXT = (
    "Bread is one of the oldest prepared foods. Evidence from thirty thousand years ago in "
    "Europe shows starch residue on rocks used for pounding plants. It is possible that "
    "during this time, starch extract from the roots of plants, such as cattails and ferns, "
    "was spread on a flat rock, placed over a fire and cooked into a primitive form of "
    "flatbread. Around ten thousand years ago, with the dawn of the Neolithic age and the "
    "spread of agriculture, grains became the mainstay of making bread."
)


@pytest.fixture(scope="module")
def engine(gemma3_gguf) -> Engine:
    gguf_file, metadata_dir = gemma3_gguf
    return Engine(EngineConfig(model=str(metadata_dir), gguf_file=str(gguf_file), device="cpu"))


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """transformers' model of the same file, every tensor de-quantized to float32."""
    from transformers import AutoModelForCausalLM

    gguf_file, _ = gemma3_gguf
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


def test_the_engine_reads_the_file_in_its_own_types(engine):
    config = engine.model.config
    assert (config.model_type, config.num_layers, config.vocab_size) == ("gemma3_text", 18, 262144)
    # the whole context served, the local layers (pattern 6: 5 of 6) over their window
    assert (config.max_context, config.window_of(0), config.window_of(5)) == (32768, 512, None)
    kinds = {
        (module.qweight.kind, module.qweight.group_size)
        for module in engine.model.modules()
        if isinstance(getattr(module, "qweight", None), QuantizedWeight)
    }
    assert {("int8", 16), ("int8", 32), ("int4", 32)} <= kinds  # Q6_K, Q5_0/Q8_0, Q4_K


@torch.inference_mode()
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(engine, reference):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    tokenizer = engine.tokenizer
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        expected = reference.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
        )[0, len(ids) :].tolist()
        assert output.token_ids == expected, (prompt, tokenizer.decode(output.token_ids))


@torch.inference_mode()
def test_perplexity_is_transformers_within_one_percent(engine, reference):
    ids = engine.tokenizer(TEXT)["input_ids"]
    assert 80 < len(ids) < 500  # within the window, long enough to mean something
    out = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    ours = [-entry.logprob for entry in out.prompt_logprobs if entry is not None]
    logits = reference(torch.tensor([ids])).logits[0, :-1].float()
    theirs = -torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    assert len(ours) == len(ids) - 1
    ratio = math.exp(sum(ours) / len(ours)) / math.exp(float(theirs.mean()))
    assert abs(ratio - 1) < 0.01, ratio


def test_the_assembled_file_is_the_package_s(gemma3_gguf):
    gguf_file, metadata_dir = gemma3_gguf
    assert gguf_file.stat().st_size == 253_113_024
    assert (Path(metadata_dir) / "tokenizer.json").is_file()


@torch.inference_mode()
def test_past_the_local_window_tokens_and_perplexity_are_transformers(engine, reference):
    """A text of ~620 tokens: the local layers drop keys more than 512 back, the global
    ones keep them all, as transformers' sliding-window masks do."""
    ids = engine.tokenizer(" ".join([TEXT] * 7))["input_ids"]
    assert 560 < len(ids) < 700
    out = engine.generate(
        [ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    )[0]
    logits = reference(torch.tensor([ids])).logits[0].float()
    assert out.token_ids[0] == int(logits[-1].argmax())
    ours = [-entry.logprob for entry in out.prompt_logprobs if entry is not None]
    theirs = -torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    ratio = math.exp(sum(ours[512:]) / len(ours[512:])) / math.exp(float(theirs[512:].mean()))
    assert abs(ratio - 1) < 0.01, ratio
