import pytest
import torch

from loramux.engine.structured import (
    allocate_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    bitmask_width,
    unpack_bitmask,
)


def _loop_reference(logits, bitmask, rows):
    """The docstring's definition, one token at a time."""
    out = logits.clone()
    rows = range(bitmask.shape[0]) if rows is None else rows.tolist()
    for b, r in enumerate(rows):
        for v in range(out.shape[1]):
            word = v // 32
            bit = (int(bitmask[b, word]) >> (v % 32)) & 1 if word < bitmask.shape[1] else 0
            if not bit:
                out[r, v] = float("-inf")
    return out


def _random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Every int32 value, the sign bit included (it stands for the 32nd token of a word).
    return torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(
        torch.int32
    )


@pytest.mark.parametrize(
    ("batch", "vocab", "words", "rows"),
    [
        (4, 64, 2, None),  # every row masked
        (5, 70, 3, [4, 0, 2]),  # a vocab that is not a multiple of 32; some rows
        (3, 100, 2, [1]),  # the logits are wider than the mask: the rest is forbidden
        (2, 33, 2, []),  # no row
        (1, 31, 1, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_the_loop_reference(batch, vocab, words, rows, dtype):
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    count = batch if rows is None else len(rows)
    bitmask = _random_bitmask(count, words, seed=vocab)
    row_map = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    expected = _loop_reference(logits, bitmask, row_map)
    apply_token_bitmask(logits, bitmask, row_map)
    assert torch.equal(logits, expected)


def test_sign_bit_stands_for_the_last_token_of_its_word():
    bitmask = torch.tensor([[-(2**31)]], dtype=torch.int32)  # only bit 31 set
    assert allowed_token_ids(bitmask[0]) == [31]
    assert unpack_bitmask(torch.tensor([[-1]], dtype=torch.int32), 32).all()


def test_allocate_allows_every_token():
    bitmask = allocate_bitmask(3, 49152 + 5)
    assert bitmask.shape == (3, bitmask_width(49157)) == (3, 1537)
    assert unpack_bitmask(bitmask, 49157).all()


def test_rows_not_named_are_untouched():
    logits = torch.randn(4, 40)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    assert torch.isneginf(logits[2]).all()


@pytest.mark.parametrize(
    ("bitmask", "rows"),
    [
        (torch.zeros(2, 2, dtype=torch.int64), None),  # dtype
        (torch.zeros(3, 2, dtype=torch.int32), None),  # rows without a map
        (torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0])),  # map of the wrong length
    ],
)
def test_mismatched_arguments_are_refused(bitmask, rows):
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(2, 64), bitmask, rows)


@pytest.mark.gpu
def test_apply_on_cuda_matches_the_cpu():
    logits = torch.randn(16, 49152)
    bitmask = _random_bitmask(5, 1536, seed=3)
    rows = torch.tensor([0, 3, 7, 8, 15])
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask, rows)
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, bitmask.pin_memory(), rows)
    assert torch.equal(on_gpu.cpu(), expected)
