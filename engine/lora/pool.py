"""Resident adapters as rank-rows at the top of the shared KV memory (S-LoRA unified paging).

An adapter of rank r owns r consecutive rows of the ``DeviceArena`` (see
``loramux.engine.memory.arena``): row i holds its i-th rank-row of A and of B
(transposed) for every target module and layer, at the same index in every module's pool.
A module or layer it does not target holds zeros there; a module whose rank is below the
adapter's largest leaves its extra rows unread.

The adapters' *region* is rows ``[first_row, total_rows)``; KV owns the blocks below
``kv.limit == layout.kv_limit_for(first_row)``. The pool keeps the region tight (it starts
at the lowest occupied row) and moves the KV limit itself:

* ``try_load`` places an adapter in the highest free run of rows that fits (adapters pack at
  the top); failing that, grows the region downward by just enough rows, which needs
  ``kv.try_lower_limit`` to succeed (the blocks are free or evictable, and KV stays at or
  above its floor). Failing that, it compacts (slides idle adapters up into free runs) and
  evicts idle adapters, least recently used first, the larger first among equally old ones,
  retrying after each. It evicts nothing when even evicting every idle adapter could not make
  room (pinned adapters, KV blocks in use, the floor or ``max_rows`` stand in the way).
* ``unload`` and evictions shrink the region to the lowest occupied row: KV gets the memory
  back at once. ``release_for_kv`` compacts and evicts on KV's behalf.
* A *pinned* adapter (in use by a running request; pins are counted) is never evicted or
  moved. Moving an idle one is safe: rows are looked up afresh by ``step_table`` every step,
  and ``weights_version`` changes with every write or move, so a backend that copied rows
  (the torch backend's stacks) knows its copy is stale.
* Recency counts steps: each ``step_table`` starts a new step and marks its adapters used;
  a load, ``touch``, ``pin`` and ``unpin`` mark the current step. Adapters last used in the
  same step are equally recent, and the larger is evicted first (it frees more rows). So a
  caller that loads several adapters for the same step pins each one it needs before loading
  the next.

Each adapter's rows are zeroed before its weights are written, so a module or layer it
does not target, and a module's rows past its own rank, read as zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.lora.mix import AdapterSpans, adapter_ids_of, not_mixable, split_passes
from loramux.engine.lora.tokens import AdapterTokens, TableSlots, table_slots
from loramux.engine.memory.arena import AdapterRows, adapter_rows
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS
from loramux.kernels.lora_batch import LoRATable

__all__ = ["LoRAPool", "PoolFull", "ResidentAdapter"]


class PoolFull(RuntimeError):
    """The adapter does not fit in device memory now; the message gives the sizes."""


@dataclass(frozen=True)
class ResidentAdapter:
    adapter_id: int
    row_start: int
    num_rows: int
    rows: torch.Tensor  # [num_rows] int64, row_start .. row_start + num_rows - 1
    modules: dict[str, tuple[int, float]]  # module -> (rank, scale)
    dora_offset: int | None = None  # which of its rows holds DoRA's scales (engine/lora/dora.py)
    bias_offset: int | None = None  # which holds its LoRA biases (engine/lora/output_terms.py)
    expert_rank: int = 0  # LoRA on a mixture's experts: each expert's rank (expert_lora.py)
    # Its embedding and head rows (engine/lora/tokens.py): the first of their rank-rows,
    # how many, and where each table's rows are among them
    token_offset: int = 0
    token_rows: int = 0
    embed: TableSlots | None = None
    head: TableSlots | None = None

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_rows

    def tokens(self) -> AdapterTokens | None:
        """Its token tables as a step's table carries them; None without any."""
        if not self.token_rows:
            return None
        return AdapterTokens(
            self.row_start + self.token_offset, self.token_rows, self.embed, self.head
        )

    @property
    def bias_row(self) -> int:
        """The pool row of its scaled LoRA biases; -1 for an adapter without them."""
        return -1 if self.bias_offset is None else self.row_start + self.bias_offset

    @property
    def dora_row(self) -> int:
        """The pool row of its DoRA scales; -1 for an adapter without DoRA."""
        return -1 if self.dora_offset is None else self.row_start + self.dora_offset


class LoRAPool:
    """Adapter residency in the arena's rows, and each step's table of them (a
    ``LoRAWeightSource`` for the kernel backends). See the module doc.

    ``max_rows`` caps the region (the rows adapters may take from the shared memory);
    None leaves only KV's floor (``kv.min_limit``) as the bound. ``on_evict(adapter_id)`` is
    called after the pool evicts an adapter on its own (not after ``unload``).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        arena: AdapterRows,
        kv: KVCacheManager,
        *,
        max_rows: int | None = None,
    ):
        if max_rows is not None and max_rows < 0:
            raise ValueError(f"max_rows must be non-negative or None, got {max_rows}")
        if kv.num_blocks != arena.layout.num_blocks:
            raise ValueError(
                f"the KV manager has {kv.num_blocks} blocks, the arena {arena.layout.num_blocks}"
            )
        if model_config.num_layers != arena.num_layers:
            raise ValueError(
                f"the model has {model_config.num_layers} layers, the arena {arena.num_layers}"
            )
        if kv.limit != kv.num_blocks:
            raise ValueError("the KV manager's limit must start at num_blocks (no adapters yet)")
        self._config = model_config
        self._arena, self._layout, self._kv = arena, arena.layout, kv
        self._device = arena.device
        # On CUDA adapters are copied in on a stream of their own, so a load overlaps the
        # step in flight instead of queueing behind it (see _copy_stream_context).
        self._copy_stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        total = self._layout.total_rows
        self.max_rows = max_rows
        # The lowest row the region may ever reach: the cap, and never below row 0.
        self._cap_row = max(0, total - max_rows) if max_rows is not None else 0
        self._first_row = total  # the region is empty
        self._resident: dict[int, ResidentAdapter] = {}
        self._pins: dict[int, int] = {}  # adapter id -> running users (absent: 0)
        self._last_use: dict[int, int] = {}  # adapter id -> step of its last use
        self._step = 0  # recency counts steps: step_table starts a new one
        self.evictions = 0
        self.on_evict: Callable[[int], None] | None = None
        self.weights_version = 0  # bumped by every write or move of rows

    # --- LoRAWeightSource ------------------------------------------------------
    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        return self._arena.a_pool(layer, module)

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        return self._arena.b_pool(layer, module)

    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]:
        return self._arena.token_slabs(first_row, rows)

    # --- accounting ------------------------------------------------------------
    def rows_of(self, adapter_id: int) -> int:
        """The rank-rows the resident adapter holds."""
        self._require(adapter_id)
        return self._resident[adapter_id].num_rows

    def rows_for(self, weights: LoRAWeights) -> int:
        """The rank-rows ``weights`` take on the device: its rank, DoRA's row, the rows of
        its embedding and head tables."""
        return adapter_rows(self._layout, self._arena.num_layers, weights)

    @property
    def rows_used(self) -> int:
        """Rows owned by resident adapters."""
        return sum(r.num_rows for r in self._resident.values())

    num_rows_used = rows_used  # the name the engine's tests knew first

    @property
    def bytes_used(self) -> int:
        """Device bytes of the rows resident adapters own."""
        return self.rows_used * self._arena.bytes_per_row

    @property
    def region_rows(self) -> int:
        """Rows taken from KV now (owned rows plus the free runs between them)."""
        return self._layout.total_rows - self._first_row

    @property
    def first_row(self) -> int:
        return self._first_row

    @property
    def capacity(self) -> int:
        """The most rows adapters could ever hold: the cap, or all the memory above KV's floor."""
        rows = self._layout.total_rows - self._layout.first_row_for(self._kv.min_limit)
        return rows if self.max_rows is None else min(rows, self.max_rows)

    def is_resident(self, adapter_id: int) -> bool:
        return adapter_id in self._resident

    def resident_ids(self) -> list[int]:
        return list(self._resident)

    def resident(self, adapter_id: int) -> ResidentAdapter:
        return self._resident[adapter_id]

    def is_pinned(self, adapter_id: int) -> bool:
        return adapter_id in self._pins

    # --- use -------------------------------------------------------------------
    def touch(self, adapter_id: int) -> None:
        """Mark the adapter used in the current step (LRU order for eviction)."""
        self._require(adapter_id)
        self._last_use[adapter_id] = self._step

    def pin(self, adapter_id: int) -> None:
        """One more running user: not evicted or moved until every pin is undone. Touches."""
        self.touch(adapter_id)
        self._pins[adapter_id] = self._pins.get(adapter_id, 0) + 1

    def unpin(self, adapter_id: int) -> None:
        """One user fewer. Touches: the adapter's last use is when its last user stopped."""
        count = self._pins.get(adapter_id, 0)
        if count == 0:
            raise ValueError(f"adapter {adapter_id} is not pinned")
        self.touch(adapter_id)
        if count == 1:
            del self._pins[adapter_id]
        else:
            self._pins[adapter_id] = count - 1

    # --- residency -------------------------------------------------------------
    def load(self, adapter_id: int, weights: LoRAWeights) -> ResidentAdapter:
        """``try_load``, or :class:`PoolFull` when the adapter does not fit now."""
        resident = self.try_load(adapter_id, weights)
        if resident is None:
            rows = self.rows_for(weights)
            pinned = sum(self._resident[a].num_rows for a in self._pins)
            raise PoolFull(
                f"adapter {adapter_id} needs {rows} rows ({rows * self._arena.bytes_per_row} "
                f"bytes) of device memory; adapters hold {self.rows_used} rows ({pinned} pinned, "
                f"which stay), at most {self.capacity} rows fit, and KV blocks in use hold "
                f"{self._kv.num_used_blocks} of {self._kv.num_blocks} blocks "
                f"({self._arena.bytes_per_block} bytes each)"
            )
        return resident

    def try_load(
        self, adapter_id: int, weights: LoRAWeights, *, kv_floor: int | None = None
    ) -> ResidentAdapter | None:
        """Make the adapter resident, or return None (nothing changed) if it cannot fit now.

        Places it in a free run, or grows the region into free KV blocks; failing both,
        compacts and evicts idle adapters (LRU, larger first on ties) and retries.
        ``kv_floor``: the region may not grow so far that KV's limit falls below it (the KV
        blocks promised to requests); rows beyond come from idle adapters or not at all. The
        region may always grow back to where it started the call, so evictions that shrink
        it do not lose the rows they freed.
        """
        if adapter_id in self._resident:
            raise ValueError(f"adapter id {adapter_id} is already resident")
        num_rows = self.rows_for(weights)
        if kv_floor is not None:
            kv_floor = min(kv_floor, self._kv.limit)
        if not self._could_fit(num_rows, kv_floor):
            return None  # not even evicting every idle adapter would do: evict nobody
        while True:
            start = self._place(num_rows, kv_floor)
            if start is not None:
                break
            # Compaction copies rows; worth it only when the free rows would add up.
            if self._free_rows_from(self._floor_row()) >= num_rows and self._compact():
                continue
            victim = self._lru_victim()
            if victim is None:
                return None
            self._evict(victim)
        self._write(start, weights)
        embed, head = table_slots(weights)
        resident = ResidentAdapter(
            adapter_id=adapter_id,
            row_start=start,
            num_rows=num_rows,
            rows=torch.arange(start, start + num_rows, device=self._device),
            modules={m: (mw.rank, mw.scale) for m, mw in weights.modules.items()},
            dora_offset=weights.dora_row,
            bias_offset=weights.bias_row,
            expert_rank=weights.expert_rank,
            token_offset=weights.num_rows,
            token_rows=num_rows - weights.num_rows,
            embed=embed,
            head=head,
        )
        self._resident[adapter_id] = resident
        self._last_use[adapter_id] = self._step
        return resident

    def kv_limit_needed(self, num_rows: int) -> int | None:
        """The KV limit at or below which an adapter of ``num_rows`` rows would fit, with
        idle adapters evicted and compacted; None when KV is not what stands in the way
        (it fits already, or pinned adapters, the cap or KV's floor leave no room).

        The pool grows its region right below the lowest pinned adapter (or from the top),
        so that is where the rows must come from. Used to hold KV blocks for an adapter
        that waits (``KVCacheManager.hold_from``).
        """
        pinned = sorted((self._resident[a] for a in self._pins), key=lambda r: r.row_start)
        low = pinned[0].row_start if pinned else self._layout.total_rows
        if any(end - start >= num_rows for start, end in self._free_runs(low, pinned)):
            return None  # a free run among the pinned ones: no KV needed
        first = low - num_rows
        if first < self._cap_row:
            return None
        limit = self._layout.kv_limit_for(first)
        if limit < self._kv.min_limit or limit >= self._kv.limit:
            return None
        return limit

    def unload(self, adapter_id: int) -> None:
        """Free the adapter's rows and give the memory below the lowest occupied row to KV."""
        self._require(adapter_id)
        if adapter_id in self._pins:
            raise ValueError(f"adapter {adapter_id} is pinned by a running request")
        self._drop(adapter_id)

    def release_for_kv(self, blocks_needed: int) -> int:
        """Compact and evict idle adapters until KV's limit has risen by ``blocks_needed``.

        Returns the blocks KV gained. Evicts only when that can reach the goal (no pinned
        adapter sits in the rows KV would need); otherwise it only compacts.
        """
        if blocks_needed <= 0:
            return 0
        before = self._kv.limit
        target = min(self._kv.num_blocks, before + blocks_needed)
        needed_row = self._layout.first_row_for(target)  # every adapter must sit at or above
        reachable = all(self._resident[a].row_start >= needed_row for a in self._pins)
        while self._kv.limit < target:
            if self._compact():
                continue
            victim = self._lru_victim() if reachable else None
            if victim is None:
                break
            self._evict(victim)
        return self._kv.limit - before

    # --- step metadata ---------------------------------------------------------
    def step_table(self, spans: AdapterSpans) -> LoRATable | None:
        """The step's adapters as a host table (None without any): tokens ``[start, end)``
        of each span use adapter id ``a``, a mix of adapters (``lora/mix.py``: its
        further parts in ``more_passes``), or None. Each call is a new step for LRU
        recency, in which the spans' adapters are used. The kernel backend turns the table
        into its own metadata; the static decode path copies it into its buffers."""
        return self._kernel_table(spans) if self._mark_used(spans) else None

    def _mark_used(self, spans: AdapterSpans) -> list[int]:
        """Start a step for LRU recency; the adapter ids its spans use."""
        used = [a for s, e, key in spans if key is not None and e > s for a in adapter_ids_of(key)]
        self._step += 1
        for adapter_id in used:
            self._require(adapter_id)
            self._last_use[adapter_id] = self._step
        return used

    def _kernel_table(self, spans: AdapterSpans) -> LoRATable:
        """The step as tables whose slices are ``LORA_TARGETS`` in order: one per pass,
        over one adapter table of (adapter, weight) entries."""
        entries, passes = split_passes(spans)
        residents = [self._resident[adapter_id] for adapter_id, _ in entries]
        modules = [[r.modules.get(m, (0, 0.0)) for r in residents] for m in LORA_TARGETS]
        weights = [weight for _, weight in entries]
        table = {
            "adapter_rows": [r.rows.tolist() for r in residents],
            "ranks": [[rank for rank, _ in per_adapter] for per_adapter in modules],
            "scales": [
                [scale * w for (_, scale), w in zip(per_adapter, weights, strict=True)]
                for per_adapter in modules
            ],
            "num_tokens": spans[-1][1] if spans else 0,
        }
        return LoRATable(
            spans=passes[0],
            **table,
            dora_rows=(
                [r.dora_row for r in residents]
                if any(r.dora_offset is not None for r in residents)
                else None
            ),
            bias_rows=(
                [r.bias_row for r in residents]
                if any(r.bias_offset is not None for r in residents)
                else None
            ),
            expert_ranks=(
                [r.expert_rank for r in residents]
                if any(r.expert_rank for r in residents)
                else None
            ),
            tokens=[r.tokens() for r in residents]
            if any(r.token_rows for r in residents)
            else None,
            more_passes=tuple(LoRATable(spans=more, **table) for more in passes[1:]),
        )

    def not_mixable(self, adapter_id: int) -> str | None:
        """Why the resident adapter cannot be part of a mix (``lora/mix.py``), if not."""
        return not_mixable(self._resident[adapter_id])

    # --- internals -------------------------------------------------------------
    def _require(self, adapter_id: int) -> None:
        if adapter_id not in self._resident:
            raise KeyError(f"adapter {adapter_id} is not resident")

    def _by_start(self, skip: int | None = None) -> list[ResidentAdapter]:
        return sorted(
            (r for a, r in self._resident.items() if a != skip), key=lambda r: r.row_start
        )

    def _free_runs(self, low: int, occupied: list[ResidentAdapter]) -> list[tuple[int, int]]:
        """Free runs ``(start, end)`` of rows in ``[low, total_rows)`` around ``occupied``
        (sorted by start; those below ``low`` are ignored), highest first."""
        runs, cursor = [], self._layout.total_rows
        for r in reversed(occupied):
            if r.row_start < low:
                break
            if r.row_end < cursor:
                runs.append((r.row_end, cursor))
            cursor = r.row_start
        if low < cursor:
            runs.append((low, cursor))
        return runs

    def _floor_row(self, kv_floor: int | None = None) -> int:
        """The lowest row the region could reach now: KV's blocks in use and floor, the cap,
        and ``kv_floor`` (the lowest KV limit this load may leave)."""
        lowest = self._kv.lowest_possible_limit()
        if kv_floor is not None:
            lowest = max(lowest, kv_floor)
        return max(self._cap_row, self._layout.first_row_for(lowest))

    def _free_rows_from(self, low: int) -> int:
        return self._layout.total_rows - low - self.rows_used

    def could_fit(self, num_rows: int) -> bool:
        """Whether an adapter of ``num_rows`` would fit now with every idle adapter gone."""
        return self._could_fit(num_rows)

    def _could_fit(self, num_rows: int, kv_floor: int | None = None) -> bool:
        """Whether some free run would fit with every idle adapter gone."""
        pinned = sorted((self._resident[a] for a in self._pins), key=lambda r: r.row_start)
        runs = self._free_runs(self._floor_row(kv_floor), pinned)
        return any(end - start >= num_rows for start, end in runs)

    def _place(self, num_rows: int, kv_floor: int | None = None) -> int | None:
        """First row for a new adapter: the top of the highest free run inside the region
        that fits, else right below the region, grown by just enough (KV and ``kv_floor``
        permitting)."""
        for start, end in self._free_runs(self._first_row, self._by_start()):
            if end - start >= num_rows:
                return end - num_rows
        first = self._first_row - num_rows
        if first < self._cap_row:
            return None
        limit = self._layout.kv_limit_for(first)
        if (kv_floor is not None and limit < kv_floor) or not self._kv.try_lower_limit(limit):
            return None
        self._first_row = first
        return first

    def _compact(self) -> bool:
        """Slide idle adapters, topmost first, up into the highest free run that fits each;
        then shrink the region. Whether anything moved."""
        moved = False
        for resident in sorted(self._resident.values(), key=lambda r: -r.row_start):
            adapter_id = resident.adapter_id
            if adapter_id in self._pins:
                continue
            resident = self._resident[adapter_id]
            runs = self._free_runs(resident.row_start, self._by_start(skip=adapter_id))
            for start, end in runs:
                new_start = end - resident.num_rows
                if end - start >= resident.num_rows and new_start > resident.row_start:
                    self._arena.move_rows(resident.row_start, new_start, resident.num_rows)
                    self.weights_version += 1
                    self._resident[adapter_id] = replace(
                        resident,
                        row_start=new_start,
                        rows=torch.arange(
                            new_start, new_start + resident.num_rows, device=self._device
                        ),
                    )
                    moved = True
                    break
        self._shrink()
        return moved

    def _lru_victim(self) -> int | None:
        idle = [a for a in self._resident if a not in self._pins]
        if not idle:
            return None
        return min(idle, key=lambda a: (self._last_use[a], -self._resident[a].num_rows))

    def _evict(self, adapter_id: int) -> None:
        self._drop(adapter_id)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(adapter_id)

    def _drop(self, adapter_id: int) -> None:
        del self._resident[adapter_id]
        del self._last_use[adapter_id]
        self._shrink()

    def _shrink(self) -> None:
        """Start the region at the lowest occupied row, giving the rows below back to KV."""
        first = min((r.row_start for r in self._resident.values()), default=None)
        first = self._layout.total_rows if first is None else first
        if first > self._first_row:
            self._kv.raise_limit(self._layout.kv_limit_for(first))
            self._first_row = first

    def _write(self, start: int, weights: LoRAWeights) -> None:
        """Zero the rows (modules and layers the adapter skips stay zero), then write A and
        B^T of each module's layers into them."""
        self.weights_version += 1
        with self._copy_stream_context():
            self._arena.write_adapter(start, weights)

    @contextlib.contextmanager
    def _copy_stream_context(self) -> Iterator[None]:
        """Run the block's device work on the copy stream, ordered against the compute stream.

        The copy stream first waits for the compute stream: rows freed by an eviction may
        still be read by the step in flight. The compute stream then waits for the copies:
        the next step reads the rows only once they are written. The engine thread never
        blocks; host sources are pinned, so the copies are asynchronous. Elsewhere: a no-op.
        """
        if self._copy_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self._device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            yield
        compute.wait_stream(self._copy_stream)

    def check_invariants(self) -> None:
        """Assert the pool's structures agree with each other and with KV (for tests)."""
        total = self._layout.total_rows
        cursor = self._first_row
        for r in self._by_start():
            assert r.row_start >= cursor, f"adapter {r.adapter_id} overlaps or leaves the region"
            assert r.rows.tolist() == list(range(r.row_start, r.row_end)), "stale rows tensor"
            cursor = r.row_end
        assert cursor <= total, "an adapter runs past the last row"
        lowest = min((r.row_start for r in self._resident.values()), default=total)
        assert self._first_row == lowest, "the region is not tight"
        assert self._first_row >= self._cap_row, "the region exceeds max_rows"
        assert self._kv.limit == self._layout.kv_limit_for(self._first_row), "KV limit drifted"
        assert set(self._pins) <= set(self._resident), "a pin on an adapter not resident"
        assert all(count > 0 for count in self._pins.values()), "a zero pin count"
        assert set(self._last_use) == set(self._resident), "LRU ticks disagree with residents"
