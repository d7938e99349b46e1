"""An adapter's own rows of the embedding and the LM head (PEFT's ``modules_to_save`` of
``embed_tokens`` / ``lm_head``, and ``trainable_token_indices``), in device memory and in a
step.

PEFT replaces rows: a token's embedding is the adapter's row where it has one, and so is
the head's row that scores it (``W.index_copy(0, ids, rows)``). The engine keeps only those
rows, in the adapter's own rank-rows after its LoRA rows (and DoRA's), so they are paged,
counted and evicted with it and come out of the memory KV shares:

* Each of those rank-rows is ``W`` elements wide in every layer's A memory and B memory:
  ``2·layers`` contiguous *slabs* of ``x`` rank-rows, each viewed as ``⌊x·W/hidden⌋`` rows
  of the embedding's width (:func:`token_table_rows` sizes ``x``). Slot ``s`` of the
  adapter's tables is row ``s mod cap`` of slab ``s div cap``.
* The embedding's rows take slots ``0 .. k_e``, the head's the next ``k_h`` (none when the
  two are the same rows: trainable tokens of a tied embedding).
* A whole table (``ids`` None) has token ``t`` at slot ``first + t``; a few rows are looked
  up by id on the host.

In a step (:class:`StepTokens`) the embedding's rows of the tokens that have them are
copied over the base embedding's, and for each LM-head row of such an adapter its columns
are recomputed from the adapter's rows. Under tensor parallelism every rank holds every
row and replaces those of its own vocabulary range: its embedding's tokens before the sum
over ranks, its logits' columns before the gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.lora.token_rows import TokenRows


def token_table_rows(count: int, row_width: int, hidden: int, num_layers: int) -> int:
    """Rank-rows holding ``count`` rows of ``hidden`` elements in ``2·num_layers`` slabs."""
    if count == 0:
        return 0
    per_slab = -(-count // (2 * num_layers))
    return -(-per_slab * hidden // row_width)


def slab_capacity(rows: int, row_width: int, hidden: int) -> int:
    return rows * row_width // hidden


@dataclass(frozen=True)
class TableSlots:
    """Where one table's rows are among an adapter's token slots."""

    first: int  # the slot of its first row
    count: int
    ids: tuple[int, ...] | None  # the token of each row; None: all tokens, in order

    @functools.cached_property
    def _slot_of(self) -> dict[int, int]:
        return {token: self.first + i for i, token in enumerate(self.ids or ())}

    def slot(self, token: int) -> int | None:
        """The slot of ``token``'s row; None where the adapter keeps the base's."""
        if self.ids is None:
            return self.first + token if 0 <= token < self.count else None
        return self._slot_of.get(token)


@dataclass(frozen=True)
class AdapterTokens:
    """A resident adapter's token tables: where its token rank-rows start, how many, and
    where each table's rows are (``LoRATable.tokens`` carries one per adapter of a step)."""

    first_row: int
    rows: int
    embed: TableSlots | None
    head: TableSlots | None


def table_slots(weights: LoRAWeights) -> tuple[TableSlots | None, TableSlots | None]:
    """The slots of an adapter's embedding and head rows (see the module doc)."""

    def slots(table: TokenRows | None, first: int) -> TableSlots | None:
        return None if table is None else TableSlots(first, table.count, table.ids)

    embed = slots(weights.embed, 0)
    if weights.head is not None and weights.head is weights.embed:
        return embed, embed
    return embed, slots(weights.head, 0 if embed is None else embed.count)


def write_tables(weights: LoRAWeights, slabs: list[torch.Tensor]) -> None:
    """Copy the adapter's embedding and head rows into its token ``slabs``."""
    embed, head = table_slots(weights)
    if weights.embed is not None:
        _write_rows(weights.embed.rows, embed.first, slabs)
    if weights.head is not None and weights.head is not weights.embed:
        _write_rows(weights.head.rows, head.first, slabs)


def _write_rows(rows: torch.Tensor, first: int, slabs: list[torch.Tensor]) -> None:
    cap = slabs[0].shape[0]
    done = 0
    while done < rows.shape[0]:
        slot = first + done
        slab, offset = divmod(slot, cap)
        n = min(cap - offset, rows.shape[0] - done)
        slabs[slab][offset : offset + n].copy_(rows[done : done + n], non_blocking=True)
        done += n


class StepTokens:
    """A step's token tables: which of its tokens take an adapter's embedding rows, and
    which adapter's head rows score each position."""

    def __init__(
        self,
        tokens: list[AdapterTokens | None],
        spans: list[tuple[int, int, int | None]],
        input_ids: list[int],
        source,  # a LoRAWeightSource: token_slabs(first_row, rows)
        vocab: range,  # the token ids this device's embedding and head hold
        device: torch.device,
    ):
        self._tokens, self._vocab, self._device = tokens, vocab, device
        # Each position's adapter, when it has a table of its own (for the head's passes)
        self._table_of: list[int | None] = [None] * len(input_ids)
        for start, end, adapter in spans:
            if adapter is not None and tokens[adapter] is not None:
                self._table_of[start:end] = [adapter] * (end - start)
        self._slabs = {
            a: source.token_slabs(t.first_row, t.rows)
            for a, t in enumerate(tokens)
            if t is not None
        }
        # Embedding rows to copy: per (adapter, slab), the positions and the slab's rows.
        embed: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for start, end, adapter in spans:
            table = None if adapter is None or tokens[adapter] is None else tokens[adapter].embed
            if table is None:
                continue
            cap = self._slabs[adapter][0].shape[0]
            for position in range(start, end):
                token = input_ids[position]
                slot = table.slot(token) if token in vocab else None
                if slot is not None:
                    slab, row = divmod(slot, cap)
                    positions, rows = embed.setdefault((adapter, slab), ([], []))
                    positions.append(position)
                    rows.append(row)
        self._embed = [
            (self._slabs[adapter][slab], self._index(positions), self._index(rows))
            for (adapter, slab), (positions, rows) in embed.items()
        ]

    @classmethod
    def for_step(cls, inputs, source, vocab: range, device: torch.device) -> StepTokens | None:
        """The step's token tables (``inputs`` a ``ForwardInputs``); None without any."""
        table = inputs.lora
        if table is None or table.tokens is None:
            return None
        return cls(table.tokens, table.spans, inputs.input_ids, source, vocab, device)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self._device)

    def replace_embeddings(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [T, hidden] (the base embedding's) with the adapters' rows copied in."""
        for slab, positions, slab_rows in self._embed:
            rows.index_copy_(0, positions, slab.index_select(0, slab_rows).to(rows.dtype))
        return rows

    def head(self, positions: list[int]) -> HeadRows | None:
        """What an LM-head pass over the step's ``positions`` (in order) replaces."""
        groups: dict[int, list[int]] = {}
        for i, position in enumerate(positions):
            adapter = self._table_of[position]
            if adapter is not None and self._tokens[adapter].head is not None:
                groups.setdefault(adapter, []).append(i)
        if not groups:
            return None
        return HeadRows(
            [
                (self._index(rows), self._tokens[a].head, self._slabs[a])
                for a, rows in groups.items()
            ],
            self._vocab,
            self._device,
        )


class HeadRows:
    """One LM-head pass's replaced columns: per adapter, its rows of the pass, recomputed
    over its head rows."""

    def __init__(self, groups, vocab: range, device: torch.device):
        self._groups = groups  # (rows of the pass, TableSlots, slabs)
        self._vocab, self._device = vocab, device

    def apply(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``logits`` [rows, this device's vocabulary] with the adapters' columns replaced
        (``hidden`` the pass's hidden states)."""
        first_id = self._vocab.start
        for rows, table, slabs in self._groups:
            h = hidden.index_select(0, rows)
            cap = slabs[0].shape[0]
            if table.ids is None:  # a whole table: this device's range of it, slab by slab
                slot, end = table.first + first_id, table.first + min(self._vocab.stop, table.count)
                while slot < end:
                    slab, offset = divmod(slot, cap)
                    n = min(cap - offset, end - slot)
                    column = slot - table.first - first_id
                    scores = h @ slabs[slab][offset : offset + n].to(h.dtype).T
                    logits[rows, column : column + n] = scores.to(logits.dtype)
                    slot += n
                continue
            by_slab: dict[int, tuple[list[int], list[int]]] = {}
            for token in table.ids:
                if token in self._vocab:
                    slab, offset = divmod(table.slot(token), cap)
                    columns, slab_rows = by_slab.setdefault(slab, ([], []))
                    columns.append(token - first_id)
                    slab_rows.append(offset)
            for slab, (columns, slab_rows) in by_slab.items():
                index = torch.tensor([columns, slab_rows], dtype=torch.long).to(self._device)
                scores = h @ slabs[slab].index_select(0, index[1]).to(h.dtype).T
                logits[rows[:, None], index[0][None, :]] = scores.to(logits.dtype)
        return logits
