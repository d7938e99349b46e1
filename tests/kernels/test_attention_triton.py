"""Triton paged attention (decode and prefill kernels) against the torch reference.

The kernels are called directly (and through ``paged_attention_triton``, the Triton
backend's op for a whole step) and compared with ``paged_attention_reference`` run on float64 copies of the same inputs:
float32 to 1e-5 relative; float16/bfloat16 must stay within twice the error of the same
reference run in that dtype. Physical blocks are shuffled with gaps; block tables are
padded with unused blocks; unused blocks and the tails of partially filled ones hold large
stale values, so reading any key outside a context wrecks the result.

Without a GPU these run in Triton's interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET=1 before triton is imported).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch

from loramux.kernels import attention_triton
from loramux.kernels import paged_attention as pa
from loramux.kernels.attention_triton import (
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)
from tests.kernels.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (q_heads, kv_heads): GQA ratios 1, 3 and 8.
HEADS = [
    pytest.param(2, 2, id="mha"),
    pytest.param(6, 2, id="gqa3"),
    pytest.param(8, 1, id="gqa8"),
]
# (block_size, head_dim): power-of-two and odd block sizes, odd head dims padded to 32/64.
SHAPES = [
    pytest.param(16, 64, id="block16-dim64"),
    pytest.param(8, 24, id="block8-dim24"),
    pytest.param(5, 40, id="block5-dim40"),
]
LOW_PRECISION = [
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]

# (context_len, new tokens). Decodes: a one-token context, a partially filled last block,
# exactly one full block, and two contexts crossing several 64-token splits.
DECODES = [(1, 1), (37, 1), (150, 1), (16, 1), (200, 1)]
# Prefill steps: a full prompt, a prefix-cache hit (long cached prefix, few new tokens),
# a middle chunk of a chunked prefill, one-token queries, a chunk ending on a block edge.
PREFILLS = [(37, 37), (150, 5), (90, 40), (16, 1), (1, 1), (24, 8)]


@dataclass
class Step:
    """One step's paged inputs: queries, caches and per-sequence tables."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    tables: list[list[int]]  # exact block lists (what the reference takes)
    padded: torch.Tensor  # [S, max_blocks] int32, rows padded with *unused* blocks
    context_lens: list[int]
    query_lens: list[int]

    def ctx(self) -> torch.Tensor:
        return torch.tensor(self.context_lens, dtype=torch.int32, device=self.query.device)

    def starts(self) -> torch.Tensor:  # [S + 1] cumulative query rows
        rows = [0, *itertools.accumulate(self.query_lens)]
        return torch.tensor(rows, dtype=torch.int32, device=self.query.device)

    def reference(self, dtype: torch.dtype, scale: float, window: int | None = None):
        return pa.paged_attention_reference(
            self.query.to(dtype),
            self.k_cache.to(dtype),
            self.v_cache.to(dtype),
            self.tables,
            self.context_lens,
            self.query_lens,
            scale,
            window=window,
        )


def _step(
    batch, q_heads, kv_heads, head_dim, block_size, dtype, seed=0, extra_blocks=2, device=DEVICE
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    needs = [math.ceil(c / block_size) for c, _ in batch]
    num_blocks = 2 * sum(needs) + extra_blocks + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    used, spare = ids[: sum(needs)], ids[sum(needs) :]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) * 50  # stale everywhere to start with
    v_cache = torch.randn(shape, generator=gen) * 50
    tables, cursor = [], 0
    for (ctx_len, _), need in zip(batch, needs, strict=True):
        table = used[cursor : cursor + need]
        cursor += need
        tables.append(table)
        for p in range(ctx_len):  # the context's keys: unit scale
            block, offset = table[p // block_size], p % block_size
            k_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=gen)
    # Table rows padded past each context with unused blocks (reserved ahead, say).
    width = max(needs) + extra_blocks
    padded = [t + spare[: width - len(t)] for t in tables]
    query = torch.randn(sum(n for _, n in batch), q_heads, head_dim, generator=gen)
    to = {"dtype": dtype, "device": device}
    return Step(
        query=query.to(**to),
        k_cache=k_cache.to(**to),
        v_cache=v_cache.to(**to),
        tables=tables,
        padded=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=[c for c, _ in batch],
        query_lens=[n for _, n in batch],
    )


def _assert_matches_reference(out: torch.Tensor, step: Step, scale: float) -> None:
    """float32: 1e-5 relative to the float64 reference; 16-bit: within 2x torch's error."""
    assert out.shape == step.query.shape
    assert out.dtype == step.query.dtype
    expected = step.reference(torch.float64, scale)
    if out.dtype == torch.float32:
        assert_close(out, expected, 1e-5)
        return
    torch_error = float((step.reference(out.dtype, scale).double() - expected).abs().max())
    error = float((out.double() - expected).abs().max())
    assert error <= 2 * torch_error, f"triton {error:.3g} vs torch {torch_error:.3g}"


def _decode(step: Step, scale: float, num_splits: int | None) -> torch.Tensor:
    return paged_decode_attention(
        step.query, step.k_cache, step.v_cache, step.padded, step.ctx(), scale, num_splits
    )


def _prefill(step: Step, scale: float) -> torch.Tensor:
    return paged_prefill_attention(
        step.query,
        step.k_cache,
        step.v_cache,
        step.padded,
        step.ctx(),
        step.starts(),
        scale,
        max(step.query_lens),
    )


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("block_size", "head_dim"), SHAPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), HEADS)
def test_decode_float32(q_heads, kv_heads, block_size, head_dim, num_splits):
    step = _step(DECODES, q_heads, kv_heads, head_dim, block_size, torch.float32)
    _assert_matches_reference(_decode(step, head_dim**-0.5, num_splits), step, head_dim**-0.5)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_decode_low_precision(dtype, num_splits):
    step = _step(DECODES, 6, 2, 24, 8, dtype, seed=1)
    _assert_matches_reference(_decode(step, 0.3, num_splits), step, 0.3)


def test_decode_empty_splits_and_empty_context():
    """7 splits of 64 tokens over contexts <= 200: the last splits of every sequence are
    empty; a zero-length context (a padded batch row) gives zeros, split or not."""
    step = _step([(200, 1), (0, 1), (3, 1)], 8, 1, 16, 4, torch.float32, seed=2)
    for num_splits in (1, 7):
        out = _decode(step, 0.25, num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        keep = [0, 2]
        live = replace(
            step,
            query=step.query[keep],
            tables=[step.tables[i] for i in keep],
            context_lens=[step.context_lens[i] for i in keep],
            query_lens=[1, 1],
        )
        _assert_matches_reference(out[keep], live, 0.25)


def test_decode_with_a_bound_on_the_contexts_instead_of_the_longest():
    """A CUDA graph launches with the context cap as ``max_context_len`` (many splits for
    short contexts): each sequence spreads its own keys over the splits, so the result is
    the same."""
    step = _step([(200, 1), (3, 1), (0, 1), (75, 1)], 6, 2, 16, 4, torch.float32, seed=7)
    out = paged_decode_attention(
        step.query,
        step.k_cache,
        step.v_cache,
        step.padded,
        step.ctx(),
        0.25,
        max_context_len=100_000,
    )
    keep = [0, 1, 3]
    live = replace(
        step,
        query=step.query[keep],
        tables=[step.tables[i] for i in keep],
        context_lens=[step.context_lens[i] for i in keep],
        query_lens=[1, 1, 1],
    )
    _assert_matches_reference(out[keep], live, 0.25)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_splits_chosen_from_the_longest_context():
    assert choose_num_splits(200, 8, 3) == 1  # short: one pass, no reduction kernel
    assert choose_num_splits(600, 1, 1) == 3  # ceil(600 / 256)
    assert choose_num_splits(100_000, 1, 1) == attention_triton.MAX_SPLITS
    assert choose_num_splits(100_000, 64, 4) == 1  # the batch alone fills the GPU
    step = _step([(600, 1), (70, 1)], 8, 1, 16, 16, torch.float32, seed=5)
    _assert_matches_reference(_decode(step, 0.25, None), step, 0.25)


def test_largest_head_dim():
    """head_dim 256 takes the smaller key tile (32 keys)."""
    decodes = _step([(70, 1), (5, 1)], 4, 2, 256, 16, torch.float32, seed=12)
    _assert_matches_reference(_decode(decodes, 0.0625, 2), decodes, 0.0625)
    prefills = _step([(70, 6), (5, 5)], 4, 2, 256, 16, torch.float32, seed=13)
    _assert_matches_reference(_prefill(prefills, 0.0625), prefills, 0.0625)


def test_decode_block_size_one():
    step = _step([(9, 1), (1, 1)], 6, 2, 8, 1, torch.float32, seed=6)
    _assert_matches_reference(_decode(step, 0.5, 2), step, 0.5)


@pytest.mark.parametrize(("block_size", "head_dim"), SHAPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), HEADS)
def test_prefill_float32(q_heads, kv_heads, block_size, head_dim):
    step = _step(PREFILLS, q_heads, kv_heads, head_dim, block_size, torch.float32)
    _assert_matches_reference(_prefill(step, head_dim**-0.5), step, head_dim**-0.5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_prefill_low_precision(dtype):
    step = _step(PREFILLS, 6, 2, 24, 8, dtype, seed=1)
    _assert_matches_reference(_prefill(step, 0.3), step, 0.3)


def test_prefill_of_a_subset_leaves_other_rows_alone():
    """``query_ends`` picks sequences of a bigger batch; rows of the others stay as they are."""
    step = _step([(20, 4), (9, 1), (30, 30)], 6, 2, 16, 8, torch.float32, seed=7)
    pick = torch.tensor([0, 2], device=DEVICE)
    starts = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([4, 35], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(step.query, 7.0)
    paged_prefill_attention(
        step.query,
        step.k_cache,
        step.v_cache,
        step.padded[pick],
        step.ctx()[pick],
        starts,
        0.25,
        30,
        query_ends=ends,
        out=out,
    )
    assert torch.equal(out[4], torch.full_like(out[4], 7.0))
    expected = step.reference(torch.float64, 0.25)
    rows = [*range(4), *range(5, 35)]
    assert_close(out[rows], expected[rows], 1e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_outputs_round_to_nearest_even(dtype):
    """q = 0 weighs two keys equally: out = (v0 + v1) / 2, exact in float32, so the stored
    result must be torch's own rounding of it (the interpreter's bf16 cast truncates)."""
    step = _step([(2, 1)], 4, 2, 64, 16, dtype, seed=8)
    step.query.zero_()
    table = step.tables[0]
    v = step.v_cache[table[0], :2].float()  # [2, Hkv, D]
    expected = ((v[0] + v[1]) / 2).to(dtype).repeat_interleave(2, dim=0)  # [Hq, D]
    decode = _decode(step, 1.0, 1)[0]
    prefill = _prefill(step, 1.0)[0]
    assert torch.equal(decode, expected)
    assert torch.equal(prefill, expected)


# --- the plan and the whole-step op -------------------------------------------------

MIXED = [(6, 1), (3, 3), (9, 2), (1, 1)]  # decode, prefill, chunk over a prefix, decode


def test_triton_plan_fields():
    tables, ctx, qlens = [[5, 2], [7], [1, 3, 4], [9]], [6, 3, 9, 1], [1, 3, 2, 1]
    sub = pa.plan_attention_triton(tables, ctx, qlens, 4, torch.device("cpu"))
    i32 = {"dtype": torch.int32}
    assert (sub.num_decodes, sub.num_prefills) == (2, 2)
    assert torch.equal(sub.decode_block_tables, torch.tensor([[5, 2, 0], [9, 0, 0]], **i32))
    assert torch.equal(sub.decode_context_lens, torch.tensor([6, 1], **i32))
    assert sub.decode_max_context_len == 6
    assert torch.equal(sub.prefill_block_tables, torch.tensor([[7, 0, 0], [1, 3, 4]], **i32))
    assert torch.equal(sub.prefill_context_lens, torch.tensor([3, 9], **i32))
    assert torch.equal(sub.prefill_query_starts, torch.tensor([1, 4], **i32))
    assert torch.equal(sub.prefill_query_ends, torch.tensor([4, 6], **i32))
    assert sub.prefill_max_query_len == 3
    # Both plans place the new tokens the same way.
    plain = pa.plan_attention(tables, ctx, qlens, 4, torch.device("cpu"))
    for name in ("positions", "new_token_slots"):
        assert torch.equal(getattr(sub, name), getattr(plain, name))
    # The torch plan attends the 2-token chunk over a prefix as two decode rows (contexts 8
    # and 9); the prompt's first chunk stays a prefill.
    assert torch.equal(plain.decode_rows, torch.tensor([0, 4, 5, 6]))
    assert plain.decode_mask.sum(dim=-1).flatten().tolist() == [6, 8, 9, 1]
    assert [(f, n) for f, n, _, _ in plain.prefill] == [(1, 3)]

    decodes = pa.plan_attention_triton(tables, ctx, [1, 1, 1, 1], 4, "cpu")
    assert (decodes.num_decodes, decodes.num_prefills) == (4, 0)
    assert decodes.decode_max_context_len == 9
    prefills = pa.plan_attention_triton(tables[:3], ctx[:3], [2, 3, 4], 4, "cpu")
    assert (prefills.num_decodes, prefills.num_prefills) == (0, 3)
    assert torch.equal(prefills.prefill_query_starts, torch.tensor([0, 2, 5], **i32))
    assert torch.equal(prefills.prefill_query_ends, torch.tensor([2, 5, 9], **i32))
    assert prefills.prefill_max_query_len == 4


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the two launchers (still running them)."""
    calls = {"decode": 0, "prefill": 0}

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        attention_triton, "paged_decode_attention", spy("decode", paged_decode_attention)
    )
    monkeypatch.setattr(
        attention_triton, "paged_prefill_attention", spy("prefill", paged_prefill_attention)
    )
    return calls


def _whole_step(step: Step, scale: float) -> torch.Tensor:
    plan = pa.plan_attention_triton(step.tables, step.context_lens, step.query_lens, 4, DEVICE)
    return attention_triton.paged_attention_triton(
        step.query, step.k_cache, step.v_cache, plan, scale
    )


@pytest.mark.parametrize(
    ("batch", "expected_calls"),
    [
        pytest.param(MIXED, {"decode": 1, "prefill": 1}, id="mixed"),
        pytest.param([(6, 1), (70, 1)], {"decode": 1, "prefill": 0}, id="decodes"),
        pytest.param([(3, 3), (9, 2)], {"decode": 0, "prefill": 1}, id="prefills"),
    ],
)
def test_whole_step_runs_each_kernel_over_its_sub_batch(kernel_calls, batch, expected_calls):
    """Decodes and prefills each go to their kernel over their own sub-batch, and every row
    comes out right."""
    step = _step(batch, 6, 2, 16, 4, torch.float32, seed=10)
    out = _whole_step(step, 0.25)
    assert kernel_calls == expected_calls
    _assert_matches_reference(out, step, 0.25)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_a_sliding_window_in_both_kernels(window):
    """Decodes over split contexts (the splits cover the window only) and prefill chunks
    over cached prefixes (rows whose window starts past a key tile see none of it) against
    the windowed reference (``test_paged_attention_reference.py`` checks its definition)."""
    scale = 24**-0.5
    decodes = _step(DECODES, 6, 2, 24, 8, torch.float32)
    expected = decodes.reference(torch.float64, scale, window)
    for num_splits in (1, 4):
        out = paged_decode_attention(
            decodes.query,
            decodes.k_cache,
            decodes.v_cache,
            decodes.padded,
            decodes.ctx(),
            scale,
            num_splits,
            window=window,
        )
        assert_close(out, expected, 1e-5)
    prefills = _step(PREFILLS, 6, 2, 24, 8, torch.float32)
    out = paged_prefill_attention(
        prefills.query,
        prefills.k_cache,
        prefills.v_cache,
        prefills.padded,
        prefills.ctx(),
        prefills.starts(),
        scale,
        max(prefills.query_lens),
        window=window,
    )
    assert_close(out, prefills.reference(torch.float64, scale, window), 1e-5)
