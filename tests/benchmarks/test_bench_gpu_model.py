"""What the GPU runner serves, at the smoke's tiny shapes: random adapters and PEFT swaps.

The adapters are made from (seed, index) alone and must parse as PEFT adapters, move the
model's greedy tokens (else the runner's token-for-token check between loramux and the
baseline would prove nothing), and reach PEFT unchanged; the baseline's swapper must
hold the batch's adapters and evict the least recently used beyond its bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.benchmarks.common.adapters import QKVO
from loramux.benchmarks.common.driver_peft import AdapterSwapper
from loramux.benchmarks.common.workload import WorkloadRequest
from loramux.benchmarks.serve.gpu_model import (
    SMOKE_MODEL,
    WARM_ADAPTER,
    baseline_model,
    lora_config,
    random_adapter_source,
    random_adapter_state,
    random_model_dir,
)
from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.engine.lora.adapter import load_adapter
from loramux.engine.model.config import ModelConfig

CONFIG = ModelConfig.from_hf_dict(SMOKE_MODEL)


def key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{which}.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    folder = tmp_path_factory.mktemp("random-model") / "tiny"
    return random_model_dir(folder, SMOKE_MODEL, lambda: tokenizer_dir)


def test_model_folder_has_the_config_and_a_tokenizer_but_no_weights(model_dir, tokenizer_dir):
    from transformers import AutoTokenizer

    assert ModelConfig.from_pretrained(model_dir) == CONFIG
    assert not list(model_dir.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode([31999, 4000]) == AutoTokenizer.from_pretrained(tokenizer_dir).decode(
        [31999, 4000]
    )
    # made once: a second call neither needs nor asks for the tokenizer's source
    assert random_model_dir(model_dir, SMOKE_MODEL, lambda: pytest.fail("asked again")) == model_dir


def test_adapter_files_parse_and_depend_only_on_seed_and_index():
    source = random_adapter_source(CONFIG, 16, seed=3, index=5, dtype=torch.float32)
    with source.materialize() as path:  # the fetch writes the two PEFT files
        weights = load_adapter(path, CONFIG, name="a5", dtype=torch.float32)
    assert set(weights.modules) == set(QKVO)
    q_proj = weights.modules["q_proj"]
    assert (q_proj.rank, q_proj.scale) == (16, 2.0)  # lora_alpha = 2r
    state = random_adapter_state(CONFIG, 16, seed=3, index=5, dtype=torch.float32)
    assert torch.equal(q_proj.a[1], state[key(1, "q_proj", "A")])
    assert torch.equal(weights.modules["o_proj"].b[0], state[key(0, "o_proj", "B")])
    again = random_adapter_state(CONFIG, 16, seed=3, index=5, dtype=torch.float32)
    other = random_adapter_state(CONFIG, 16, seed=3, index=6, dtype=torch.float32)
    assert all(torch.equal(state[name], again[name]) for name in state)
    assert not any(torch.equal(state[name], other[name]) for name in state)
    bf16 = random_adapter_state(CONFIG, 8, seed=3, index=5, dtype=torch.bfloat16)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}


def test_random_adapters_change_greedy_tokens(model_dir):
    engine = Engine(
        EngineConfig(
            model=str(model_dir), load_format="random", device="cpu", kv_cache_bytes=4 << 20
        )
    )
    for k, rank in enumerate((64, 8)):
        source = random_adapter_source(CONFIG, rank, seed=0, index=k, dtype=torch.float32)
        engine.register_adapter(f"a{k}", source)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [100, 2000, 3000, 400, 5000, 66, 777, 8888]
    outs = engine.generate([prompt] * 3, params, adapters=["a0", "a1", None])
    tokens = [tuple(o.token_ids) for o in outs]
    assert len(set(tokens)) == 3, tokens
    engine.close()


def request(index: int, adapter: int | None) -> WorkloadRequest:
    return WorkloadRequest(
        index=index, arrival_s=0.0, adapter=adapter, prompt_len=4, output_len=2, tenant="t"
    )


def test_swapper_holds_each_batch_and_evicts_the_least_recently_used(model_dir):
    model = baseline_model(model_dir, seed=0, dtype=torch.float32, device="cpu", warm_rank=8)
    made: list[int] = []

    def make_state(k: int):
        made.append(k)
        return lora_config(8), random_adapter_state(CONFIG, 8, seed=0, index=k, dtype=torch.float32)

    swapper = AdapterSwapper(model, make_state, resident=3, workers=1, held=[WARM_ADAPTER])
    first = [request(0, 0), request(1, 1), request(2, None)]
    second = [request(3, 1), request(4, 2), request(5, 3)]
    swapper.before_batch(first, second)  # loads a0, a1; starts making a2, a3
    assert set(model.peft_config) == {WARM_ADAPTER, "a0", "a1"}
    swapper.before_batch(second, [])  # a1 used again; warm and a0 out; a2, a3 in
    assert set(model.peft_config) == {"a1", "a2", "a3"}
    assert (swapper.stats["adapter_loads"], swapper.stats["adapter_evictions"]) == (4, 2)
    third = [request(6, 4), request(7, 5), request(8, 6), request(9, 7)]
    swapper.before_batch(third, [])  # more than the bound: the batch's own, and one
    assert set(model.peft_config) == {"a3", "a4", "a5", "a6", "a7"}
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    model.generate(  # PEFT still serves a mixed batch after the swaps
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        adapter_names=["a4", "__base__"],
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=0,
    )
    assert sorted(made) == list(range(8))  # each made once
    loaded = model.base_model.model.model.layers[1].self_attn.v_proj.lora_A["a5"].weight
    expected = random_adapter_state(CONFIG, 8, seed=0, index=5, dtype=torch.float32)
    assert torch.equal(loaded, expected[key(1, "v_proj", "A")])
    assert swapper.stats["max_adapters_held"] == 5  # room is made before loading
    swapper.close()
