"""What some adapters add to a projection's output beyond ``s·B A x``, per output feature:

* DoRA's ``e ⊙ (y − b)``, ``e = g − 1`` (``dora.py``), from the adapter's DoRA row;
* a LoRA bias (PEFT's ``lora_bias``: ``lora_B`` with a bias ``b_B``), ``s·b_B``, from the
  adapter's bias row.

Both rows are the B side of a rank-row of the adapter's own (the A side stays zero, so the
LoRA ops, which read only an adapter's first ``rank`` rows, never see them). A step adds the
terms with a few torch ops per projection for the tokens of the adapters that have them
(``y`` is the projection's output with its bias, before the LoRA deltas are added); such
steps do not run over the static decode buffers. Under tensor parallelism the DoRA term is
linear in ``W x`` and the bias row of a row-parallel module is rank 0's alone (zeros on the
others), so each rank adds them to its partial output before the projection's all-reduce.
"""

from __future__ import annotations

import torch

from loramux.engine.model.llama import LoRAWeightSource
from loramux.kernels.lora_batch import LoRATable


def _token_rows(spans, rows_of: list[int]) -> tuple[list[int], list[int]]:
    """The tokens of adapters whose row (``rows_of[a]``) is set, and that row for each."""
    tokens: list[int] = []
    rows: list[int] = []
    for start, end, adapter in spans:
        row = -1 if adapter is None else rows_of[adapter]
        if row >= 0:
            tokens.extend(range(start, end))
            rows.extend([row] * (end - start))
    return tokens, rows


class StepOutputTerms:
    """A step's DoRA and LoRA-bias terms (a ``OutputTerms``, see the module doc)."""

    def __init__(self, dora, bias, pools: LoRAWeightSource):
        self.dora, self.bias, self.pools = dora, bias, pools  # (tokens, rows) [n] int64, or None

    @classmethod
    def for_step(
        cls, table: LoRATable, pools: LoRAWeightSource, device: torch.device
    ) -> StepOutputTerms | None:
        """The terms of ``table``'s adapters; None when none of them has any."""
        parts = []
        for rows_of in (table.dora_rows, table.bias_rows):
            tokens, rows = ([], []) if rows_of is None else _token_rows(table.spans, rows_of)
            if tokens:
                index = torch.tensor([tokens, rows], dtype=torch.long).to(device)
                parts.append((index[0], index[1]))
            else:
                parts.append(None)
        if parts == [None, None]:
            return None
        return cls(*parts, pools)

    def add(self, outs, biases, layer: int, modules: tuple[str, ...]) -> None:
        for out, bias, module in zip(outs, biases, modules, strict=True):
            pool = self.pools.b_pool(layer, module)
            if self.dora is not None:
                tokens, rows = self.dora
                base = out.index_select(0, tokens)
                if bias is not None:
                    base = base - bias
                out.index_add_(0, tokens, pool.index_select(0, rows) * base)
            if self.bias is not None:
                tokens, rows = self.bias
                out.index_add_(0, tokens, pool.index_select(0, rows))
