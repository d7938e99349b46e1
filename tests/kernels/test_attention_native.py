"""The CPU's native prefill attention (kernels/csrc/prefill_attention_cpu.c) against the
definition (paged_attention_reference): chunks with and without a cached prefix, across the
kernel's query and key blocks (32 and 64), shared KV heads, heads of 64 and 128, stale cache
contents around the sequence's own slots; and the backend's attention taking it."""

from __future__ import annotations

import pytest
import torch

from loramux.kernels.attention_native import load_native_prefill_attention
from loramux.kernels.paged_attention import (
    attend_reference,
    paged_attention_reference,
    plan_attention,
)

BLOCK = 16


@pytest.fixture(scope="module")
def op():
    native, how = load_native_prefill_attention()
    if native is None:
        pytest.fail(f"the native prefill attention did not build: {how}")
    if not native.takes(torch.zeros(1, 1, 64), torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64)):
        pytest.skip("this CPU has no AVX-512: the engine uses SDPA for prefill attention")
    return native


def _case(n, context, heads, kv_heads, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK) + 5
    shape = (blocks, BLOCK, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator) for _ in range(2))
    table = torch.randperm(blocks, generator=generator)[: -(-context // BLOCK)].tolist()
    query = torch.randn(n, heads, dim, generator=generator)
    return query, k_cache, v_cache, table


@pytest.mark.parametrize(
    ("n", "context", "heads", "kv_heads", "dim"),
    [
        (1, 1, 2, 1, 64),  # one token
        (37, 37, 9, 3, 64),  # a whole short prompt: a partial query and key block
        (96, 96, 9, 3, 64),  # whole blocks of both
        (50, 130, 9, 3, 64),  # a chunk over a cached prefix of 80
        (70, 201, 4, 2, 128),
        (33, 300, 4, 4, 128),  # no sharing
    ],
)
def test_prefill_attention_matches_the_definition(op, n, context, heads, kv_heads, dim):
    query, k_cache, v_cache, table = _case(n, context, heads, kv_heads, dim)
    scale = dim**-0.5
    expected = paged_attention_reference(query, k_cache, v_cache, [table], [context], [n], scale)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    out = torch.full_like(query, float("nan"))
    op.attend(query, k_cache, v_cache, slots, scale, out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_the_backend_s_attention_takes_it_for_prefill_rows_beside_decodes(op):
    # Two sequences decode, one prefills a chunk over a prefix: the decodes keep SDPA, the
    # chunk takes the native op, and together they give the definition's rows.
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, blocks = 6, 2, 64, 40
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=generator)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=generator)
    tables = [[3, 9], [1, 2, 5, 7, 11], [20]]
    contexts, queries = [20, 75, 9], [1, 45, 1]
    query = torch.randn(sum(queries), heads, dim, generator=generator)
    plan = plan_attention(tables, contexts, queries, BLOCK, torch.device("cpu"))
    expected = attend_reference(query, k_cache, v_cache, plan, 0.125)
    got = attend_reference(query, k_cache, v_cache, plan, 0.125, prefill=op)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_it_leaves_other_operands_to_sdpa(op):
    query = torch.zeros(4, 2, 64)
    assert op.takes(query, torch.zeros(2, BLOCK, 1, 64), torch.zeros(2, BLOCK, 1, 64))
    assert not op.takes(
        torch.zeros(4, 2, 32), torch.zeros(2, BLOCK, 1, 32), torch.zeros(2, BLOCK, 1, 32)
    )
    half = torch.zeros(2, BLOCK, 1, 64, dtype=torch.float16)
    assert not op.takes(query, half, half)
    assert not op.takes(
        query.transpose(0, 1), torch.zeros(2, BLOCK, 1, 64), torch.zeros(2, BLOCK, 1, 64)
    )
