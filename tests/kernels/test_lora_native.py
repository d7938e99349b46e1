"""The CPU's native LoRA op (``loramux.kernels.lora_native``) against the multi-slice reference.

The pools are laid out as the engine's arena lays them: one wide buffer of rows, each slice a
strided view at its own offset, rows outside every adapter NaN (the op must never read them).
The step mixes long segments (prefill chunks) and short ones (decodes, one and two tokens),
ranks that differ per slice (0: the slice is not targeted), and tokens with no adapter. The op
is built here as the engine builds it: under CI a machine without a C compiler fails these
tests rather than skipping them.
"""

from __future__ import annotations

import os

import pytest
import torch

from loramux.kernels.lora_native import NativeLoRA, load_native_lora
from tests.kernels.helpers import (
    FIRST_ROWS,
    POOL_ROWS,
    RANKS,
    SCALES,
    SPANS,
    TOKENS,
    assert_close,
    multi_slice_expected,
)

IN_FEATURES = 37
OUT_WIDTHS = (1100, 6, 33)  # 1100: an output wider than one expand block
RANK_WIDTH = 16


@pytest.fixture(scope="module")
def native() -> NativeLoRA:
    op, how = load_native_lora()
    assert op is not None, f"the native LoRA op must build here: {how}"
    return op


def _pools():
    """x, the A and B pools (strided views of one buffer each, as the arena's), and outs."""
    gen = torch.Generator().manual_seed(0)
    a_rows = torch.full((POOL_ROWS, 3 * IN_FEATURES + 5), float("nan"))
    b_rows = torch.full((POOL_ROWS, sum(OUT_WIDTHS) + 3), float("nan"))
    b_offsets = [0, OUT_WIDTHS[0], OUT_WIDTHS[0] + OUT_WIDTHS[1]]
    a_pools = [a_rows[:, s * IN_FEATURES : (s + 1) * IN_FEATURES] for s in range(3)]
    b_pools = [b_rows[:, o : o + w] for o, w in zip(b_offsets, OUT_WIDTHS, strict=True)]
    for first, ranks in zip(FIRST_ROWS, zip(*RANKS, strict=True), strict=True):
        owned = max(ranks)
        for s, rank in enumerate(ranks):
            a_pools[s][first : first + owned] = 0  # the pool zeroes an adapter's rows
            b_pools[s][first : first + owned] = 0
            a_pools[s][first : first + rank] = torch.randn(rank, IN_FEATURES, generator=gen)
            b_pools[s][first : first + rank] = torch.randn(rank, OUT_WIDTHS[s], generator=gen)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen)
    outs = [torch.randn(TOKENS, w, generator=gen) for w in OUT_WIDTHS]
    return x, a_pools, b_pools, outs


def _expected(x, a_pools, b_pools, outs) -> torch.Tensor:
    return multi_slice_expected(x, a_pools, b_pools, outs, SPANS, FIRST_ROWS, RANKS, SCALES)


def _operands(spans=SPANS):
    """The op's segments, ranks and scales for ``spans`` (segments with an adapter)."""
    segments, ranks, scales = [], [], []
    for start, end, adapter in spans:
        if adapter is not None:
            segments.append((start, end, FIRST_ROWS[adapter]))
            ranks.append([RANKS[s][adapter] for s in range(3)])
            scales.append([SCALES[s][adapter] for s in range(3)])
    return segments, ranks, scales


def _apply(native, x, a_pools, b_pools, outs, spans=SPANS):
    scratch = torch.empty(TOKENS, 3 * RANK_WIDTH)
    call = native.prepare(x, outs, a_pools, b_pools, *_operands(spans), scratch, RANK_WIDTH)
    native.apply(x, outs, a_pools, b_pools, call)


def test_the_op_matches_the_reference(native):
    x, a_pools, b_pools, outs = _pools()
    expected = _expected(x, a_pools, b_pools, outs)
    no_adapter = [t for s, e, a in SPANS if a is None for t in range(s, e)]
    before = [o.clone() for o in outs]

    _apply(native, x, a_pools, b_pools, outs)

    assert_close(torch.cat(outs, dim=1), expected, 1e-5)
    for out, old in zip(outs, before, strict=True):
        assert torch.equal(out[no_adapter], old[no_adapter])


def test_one_slice_and_the_torch_thread_count(native):
    """A group of one (o_proj, down_proj), run on one thread and on the default: the same."""
    x, a_pools, b_pools, outs = _pools()
    segments, ranks, scales = _operands()
    one = [[r[1]] for r in ranks], [[c[1]] for c in scales]
    results = []
    threads = torch.get_num_threads()
    for count in (1, threads):
        torch.set_num_threads(count)
        try:
            out = outs[1].clone()
            scratch = torch.empty(TOKENS, RANK_WIDTH)
            call = native.prepare(
                x, [out], a_pools[1:2], b_pools[1:2], segments, *one, scratch, RANK_WIDTH
            )
            native.apply(x, [out], a_pools[1:2], b_pools[1:2], call)
            results.append(out)
        finally:
            torch.set_num_threads(threads)
    expected = _expected(x, a_pools, b_pools, outs)[:, OUT_WIDTHS[0] : sum(OUT_WIDTHS[:2])]
    for out in results:
        assert_close(out, expected, 1e-5)
    assert torch.equal(results[0], results[1])  # each output's sums run in one fixed order


def test_an_adapter_with_non_finite_weights_touches_only_its_tokens(native):
    x, a_pools, b_pools, outs = _pools()
    first = FIRST_ROWS[0]
    for s in range(3):
        b_pools[s][first : first + RANKS[s][0]] = float("inf")
        a_pools[s][first : first + RANKS[s][0]] = float("nan")
    _apply(native, x, a_pools, b_pools, outs)
    own = {t for s, e, a in SPANS if a == 0 for t in range(s, e)}
    for t in range(TOKENS):
        finite = all(bool(o[t].isfinite().all()) for o in outs)
        assert finite == (t not in own), t


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ops: ops["segments"].__setitem__(0, (30, 36, 3)), "outside x's 35 tokens"),
        (lambda ops: ops["segments"].__setitem__(0, (0, 1, 61)), "outside the pools' 64 rows"),
        (lambda ops: ops["ranks"].__setitem__(0, [32, 4, 1]), r"not within 0\.\.16"),
        (lambda ops: ops["ranks"].__setitem__(0, [4, 1]), "a rank and a scale per slice"),
        (lambda ops: ops.__setitem__("x", ops["x"].double()), "x: a 2-D float32 CPU tensor"),
        (lambda ops: ops["outs"].__setitem__(0, ops["outs"][0].T.contiguous().T), "out 0"),
        (lambda ops: ops["a_pools"].__setitem__(1, ops["a_pools"][1].clone()), "one row stride"),
        (lambda ops: ops.__setitem__("scratch", torch.empty(TOKENS, 8)), "scratch"),
    ],
    ids=[
        "tokens",
        "rows",
        "rank",
        "slices",
        "dtype",
        "strided-out",
        "pool-strides",
        "scratch",
    ],
)
def test_bad_operands_are_refused_before_the_c_code_sees_them(native, change, message):
    x, a_pools, b_pools, outs = _pools()
    segments, ranks, scales = _operands()
    operands = {
        "x": x,
        "outs": outs,
        "a_pools": a_pools,
        "b_pools": b_pools,
        "segments": segments,
        "ranks": ranks,
        "scales": scales,
        "scratch": torch.empty(TOKENS, 3 * RANK_WIDTH),
    }
    change(operands)
    with pytest.raises(ValueError, match=message):
        native.prepare(**operands, rank_width=RANK_WIDTH)


def test_a_prepared_call_refuses_other_shapes(native):
    x, a_pools, b_pools, outs = _pools()
    scratch = torch.empty(TOKENS, 3 * RANK_WIDTH)
    call = native.prepare(x, outs, a_pools, b_pools, *_operands(), scratch, RANK_WIDTH)
    before = [o.clone() for o in outs]
    with pytest.raises(ValueError, match="differ from the prepared call's"):
        native.apply(x[:-1], [o[:-1] for o in outs], a_pools, b_pools, call)
    with pytest.raises(ValueError, match="differ from the prepared call's"):
        native.apply(x, outs, [p[:-1] for p in a_pools], b_pools, call)
    assert all(torch.equal(o, b) for o, b in zip(outs, before, strict=True))


def test_the_library_is_built_once_per_machine_and_source(tmp_path):
    first, how = load_native_lora(tmp_path)
    assert first is not None, how
    built = sorted(tmp_path.iterdir())
    assert [p.suffix for p in built] == [".so"]  # no temporary file left behind
    stamp = built[0].stat().st_mtime_ns
    again, _ = load_native_lora(tmp_path)
    assert again.path == first.path and built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_it_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", os.fspath(tmp_path / "no-such-cc"))
    op, how = load_native_lora(tmp_path / "cache")
    assert op is None
    assert "no-such-cc" in how and "does not run" in how
    assert not (tmp_path / "cache").exists()
