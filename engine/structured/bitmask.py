"""Token bitmasks, and masking a batch's logits with them.

A bitmask row holds one bit per token: ``W = ceil(V / 32)`` int32 words, token ``v`` in bit
``v % 32`` of word ``v // 32`` (1 = allowed). That is llguidance's layout (and xgrammar's),
so the library writes rows in place. Rows are filled on the CPU (pinned memory on CUDA
makes the copy to the device asynchronous) and applied on the logits' device.
"""

from __future__ import annotations

import torch

ALL_ALLOWED = -1  # every bit set: an int32 word that allows its 32 tokens


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An int32 CPU bitmask ``[rows, ceil(vocab_size / 32)]``, every token allowed."""
    shape = (rows, bitmask_width(vocab_size))
    return torch.full(shape, ALL_ALLOWED, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask ``[rows, vocab_size]`` a bitmask ``[rows, W]`` stands for; tokens at
    or past ``32 W`` are not allowed."""
    rows, words = bitmask.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # An arithmetic shift of a negative word keeps copying its sign bit, so bit 31 reads
    # right too: (w >> s) & 1 is bit s of w for every s in [0, 32).
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, W, 32]
    allowed = bits.view(rows, words * 32).bool()  # [rows, 32 W]
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(rows, vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


def token_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a bitmask ``[B, W]``: ``[B, vocab_size]`` of 0 where a token is
    allowed and ``-inf`` where not (tokens at or past ``32 W`` too), on the bitmask's device.

    Each byte of the int32 words is looked up in a 256-row table of its 8 bits' biases:
    one gather instead of a shift per bit, and an add instead of a boolean masked fill
    (five times faster on the CPU). Little-endian words: byte k of word w holds the bits
    of tokens 32 w + 8 k ... 32 w + 8 k + 7, lowest first.
    """
    rows, words = bitmask.shape
    device = bitmask.device
    bits = (torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(8, device=device)) & 1
    table = torch.zeros(256, 8, dtype=dtype, device=device).masked_fill_(bits == 0, float("-inf"))
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [B, 4 W]
    bias = torch.nn.functional.embedding(as_bytes, table).view(rows, words * 32)  # [B, 32 W]
    if words * 32 >= vocab_size:
        return bias[:, :vocab_size]
    return torch.nn.functional.pad(bias, (0, vocab_size - words * 32), value=float("-inf"))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set, in place, every logit a bitmask forbids to ``-inf``.

    ``logits`` ``[R, V]`` (any float dtype and device); ``bitmask`` int32 ``[B, W]``;
    ``rows`` int64 ``[B]``, the distinct logits rows the bitmask rows mask, in order (None:
    ``B == R``, row b masks row b). For each b and each token v < V::

        allowed(b, v) = (bitmask[b, v // 32] >> (v % 32)) & 1   # tokens v >= 32 W: 0
        logits[rows[b], v] = logits[rows[b], v] if allowed(b, v) else -inf

    computed as ``logits[rows[b]] += token_bias(bitmask)[b]`` (0 or ``-inf``), which is that
    for every finite logit; the runner has zeroed non-finite rows before sampling. Rows not
    named are untouched. A row whose mask allows nothing becomes all ``-inf``: the caller
    keeps that from happening (a finished or failed matcher allows EOS). The torch
    reference, which this computes with batched tensor ops instead of loops::

        for b, r in enumerate(rows):
            for v in range(V):
                if not (int(bitmask[b, v // 32]) >> (v % 32)) & 1:
                    logits[r, v] = float("-inf")
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"want logits [R, V] and an int32 bitmask [B, W]; got {tuple(logits.shape)} "
            f"and {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    count = bitmask.shape[0]
    if rows is None and count != logits.shape[0]:
        raise ValueError(f"{count} bitmask rows for {logits.shape[0]} logits rows, no row map")
    if rows is not None and rows.shape != (count,):
        raise ValueError(f"rows must be [{count}], got {tuple(rows.shape)}")
    if count == 0:
        return
    device = logits.device
    bias = token_bias(bitmask.to(device, non_blocking=True), logits.shape[1], logits.dtype)
    if rows is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, rows.to(device, non_blocking=True), bias)


def allowed_token_ids(bitmask_row: torch.Tensor) -> list[int]:
    """The token ids one bitmask row allows (for tests and debugging)."""
    words = bitmask_row.reshape(1, -1)
    return unpack_bitmask(words, words.shape[1] * 32)[0].nonzero().flatten().tolist()
