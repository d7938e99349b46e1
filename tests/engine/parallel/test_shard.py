"""The split of the model and of each adapter over ranks, checked against whole-model maths:
the ranks' column-parallel outputs put together, and their row-parallel partial sums added,
give the whole projection, with and without a LoRA delta; queries read the KV head they
read in the whole model, also where KV heads are replicated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loramux.engine.model.config import ModelConfig
from loramux.engine.parallel.shard import ShardPlan, TensorParallelError

CONFIG = ModelConfig(
    vocab_size=101,  # not a multiple of 2 or 3: the last rank's range is padded
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=3,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    attention_bias=True,
    mlp_bias=True,
)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _weight(module: str, generator: torch.Generator) -> torch.Tensor:
    inp, out = CONFIG.module_shape(module)
    return torch.randn(out, inp, generator=generator, dtype=torch.float64)


def _plans(world: int) -> list[ShardPlan]:
    return [ShardPlan(CONFIG, world, rank) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3, 6])
def test_local_configs_hold_a_share_of_every_dimension(world):
    for plan in _plans(world):
        local = plan.local_config()
        assert local.num_heads * world == CONFIG.num_heads
        assert local.intermediate_size * world == CONFIG.intermediate_size
        assert local.vocab_size == -(-CONFIG.vocab_size // world)
        assert (local.hidden_size, local.head_dim) == (CONFIG.hidden_size, CONFIG.head_dim)
        assert local.num_heads % local.num_kv_heads == 0
    # 3 KV heads: split over 3 ranks; repeated twice over 2 (and over 6) so the copies split.
    assert [ShardPlan(CONFIG, w, 0).kv_copies for w in (2, 3, 6)] == [2, 1, 2]
    assert [ShardPlan(CONFIG, w, 0).local_kv_heads for w in (2, 3, 6)] == [3, 1, 1]


@pytest.mark.parametrize("world", [2, 3, 6])
def test_queries_read_the_kv_head_they_read_in_the_whole_model(world):
    """Local query head j of rank k reads local KV head j // local group; its key features
    must be those of KV head (global query head) // group in the whole model."""
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    d = CONFIG.head_dim
    for plan in _plans(world):
        keys = plan.out_features("k_proj").view(-1, d)[:, 0] // d  # the whole model's KV heads
        queries = plan.out_features("q_proj").view(-1, d)[:, 0] // d
        local_group = plan.local_heads // plan.local_kv_heads
        for j, query in enumerate(queries.tolist()):
            assert int(keys[j // local_group]) == query // group


@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_shards_make_the_whole_projection_with_its_lora_delta(world):
    generator = torch.Generator().manual_seed(0)
    for module in COLUMN + ROW:
        weight = _weight(module, generator)
        bias = torch.randn(weight.shape[0], generator=generator, dtype=torch.float64)
        a = torch.randn(4, weight.shape[1], generator=generator, dtype=torch.float64)
        b = torch.randn(weight.shape[0], 4, generator=generator, dtype=torch.float64)
        inputs = torch.randn(5, weight.shape[1], generator=generator, dtype=torch.float64)
        whole = inputs @ weight.T + bias + 0.5 * (inputs @ a.T) @ b.T
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.0.{block}.{module}"
        parts = []
        for plan in _plans(world):
            local_in = inputs if module in COLUMN else inputs[:, plan.in_features(module)]
            w = plan.shard_weight(f"{name}.weight", weight)
            a_k, b_k = plan.shard_lora_a(module, a), plan.shard_lora_b(module, b)
            local_bias = plan.shard_weight(f"{name}.bias", bias)
            parts.append(local_in @ w.T + local_bias + 0.5 * (local_in @ a_k.T) @ b_k.T)
        if module in COLUMN:  # each rank's output features, in the model's order
            got = torch.zeros_like(whole)
            for plan, part in zip(_plans(world), parts, strict=True):
                got[:, plan.out_features(module)] = part
        else:  # partial sums, added by the all-reduce (the bias counted once)
            got = sum(parts)
        torch.testing.assert_close(got, whole, msg=module)


def test_vocabulary_ranges_cover_every_token_once():
    embedding = torch.arange(CONFIG.vocab_size, dtype=torch.float64)[:, None].repeat(1, 4)
    for world in (2, 3):
        rows = [p.shard_weight("model.embed_tokens.weight", embedding) for p in _plans(world)]
        assert all(r.shape == (_plans(world)[0].local_vocab, 4) for r in rows)
        gathered = torch.cat(rows)[: CONFIG.vocab_size]
        torch.testing.assert_close(gathered, embedding)
        assert float(torch.cat(rows)[CONFIG.vocab_size :].abs().sum()) == 0  # padding


def test_a_split_that_cannot_work_is_refused_with_the_reason():
    with pytest.raises(TensorParallelError, match="must divide the model's 6 attention heads"):
        ShardPlan(CONFIG, 4, 0)
    odd_ffn = dataclasses.replace(CONFIG, intermediate_size=95)
    with pytest.raises(TensorParallelError, match="intermediate size 95"):
        ShardPlan(odd_ffn, 2, 0)
