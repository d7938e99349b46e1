"""Resident adapters in a row pool: an adapter of rank r owns r rank-rows.

Every target module has, per layer, an A pool ``[rows, in]`` and a B pool
``[rows, out]`` (B stored transposed so a rank-row is contiguous). An adapter's rows
have the same indices in every module's pool; a module it does not target is simply
left out of that module's segments. The pool grows (doubling) when it runs out of
rows; removing an adapter frees its rows for the next one. This is the simple
residency the engine starts with; the adapter-tiers work adds host and device
budgets on top of the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS, LoRASegment, LoRAStep, LoRAWeightSource
from loramux.kernels.dispatch import use_triton_on
from loramux.kernels.lora import LoRADenseBatch
from loramux.kernels.lora_batch import LoRABatch

# The masked-dense form computes every token against every row of the step's span:
# worth it while the span is small (CPU, a few dozen adapters of modest rank).
DENSE_MAX_ROWS = 512


@dataclass(frozen=True)
class ResidentAdapter:
    adapter_id: int
    row_start: int
    num_rows: int
    rows: torch.Tensor  # [num_rows] int64
    modules: dict[str, tuple[int, float]]  # module -> (rank, scale)


class LoRAPool(LoRAWeightSource):
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        initial_rows: int = 64,
    ):
        self._config = model_config
        self._dtype, self._device = dtype, device
        self._capacity = initial_rows
        self._row_used = bytearray(initial_rows)  # 1 = owned by an adapter
        self._a: dict[str, list[torch.Tensor]] = {}  # module -> per layer [capacity, in]
        self._b: dict[str, list[torch.Tensor]] = {}  # module -> per layer [capacity, out]
        self._resident: dict[int, ResidentAdapter] = {}
        # The Triton ops take a fused projection's slices (q/k/v, gate/up) in one launch,
        # so every target module has a pool there (zero rows for adapters skipping it).
        self._triton = use_triton_on(device)
        if self._triton:
            for module in LORA_TARGETS:
                self._ensure_module(module)

    # --- LoRAWeightSource ------------------------------------------------------
    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        return self._a[module][layer]

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        return self._b[module][layer]

    # --- residency -------------------------------------------------------------
    @property
    def num_rows_used(self) -> int:
        return sum(self._row_used)

    @property
    def capacity(self) -> int:
        return self._capacity

    def load(self, adapter_id: int, weights: LoRAWeights) -> ResidentAdapter:
        if adapter_id in self._resident:
            raise ValueError(f"adapter id {adapter_id} is already resident")
        num_rows = weights.rank
        start = self._find_rows(num_rows)
        if start is None:
            self._grow(max(self._capacity * 2, self._capacity + num_rows))
            start = self._find_rows(num_rows)
        assert start is not None
        for module, mw in weights.modules.items():
            self._ensure_module(module)
            for layer in range(self._config.num_layers):
                a_pool, b_pool = self._a[module][layer], self._b[module][layer]
                rows = slice(start, start + mw.rank)
                if layer in mw.a:
                    a_pool[rows] = mw.a[layer].to(self._dtype)
                    b_pool[rows] = mw.b[layer].T.to(self._dtype)
                else:  # a layer the adapter skips: zero rows add exactly nothing
                    a_pool[rows] = 0
                    b_pool[rows] = 0
        self._row_used[start : start + num_rows] = b"\x01" * num_rows
        resident = ResidentAdapter(
            adapter_id=adapter_id,
            row_start=start,
            num_rows=num_rows,
            rows=torch.arange(start, start + num_rows, device=self._device),
            modules={m: (mw.rank, mw.scale) for m, mw in weights.modules.items()},
        )
        self._resident[adapter_id] = resident
        return resident

    def unload(self, adapter_id: int) -> None:
        resident = self._resident.pop(adapter_id)
        end = resident.row_start + resident.num_rows
        self._row_used[resident.row_start : end] = bytes(resident.num_rows)

    def build_step(self, spans: list[tuple[int, int, int | None]]) -> LoRAStep | None:
        """LoRA metadata for a batch whose tokens [start, end) use adapter ids (or None).

        Per module, either segments (one matmul pair per adapter) or, when the step's
        adapters sit in a short span of rows, the masked-dense form (a fixed number of
        ops whatever the adapter count): see ``loramux.kernels.lora``.
        """
        used = [(s, e, self._resident[a]) for s, e, a in spans if a is not None and e > s]
        if not used:
            return None
        if self._triton:
            return LoRAStep(pools=self, segments={}, max_rank={}, batch=self._kernel_batch(spans))
        segments: dict[str, list[LoRASegment]] = {}
        max_rank: dict[str, int] = {}
        for start, end, resident in used:
            for module, (rank, scale) in resident.modules.items():
                segments.setdefault(module, []).append(
                    LoRASegment(
                        start=start,
                        end=end,
                        rows=resident.rows[:rank],
                        rank=rank,
                        scale=scale,
                        contiguous_start=resident.row_start,
                    )
                )
                max_rank[module] = max(max_rank.get(module, 0), rank)
        dense = {}
        if self._device.type == "cpu" and len(used) > 1:
            num_tokens = spans[-1][1]
            # Modules with the same segments (an adapter targeting several modules) share
            # one batch: the mask and scales depend on the segments only.
            built: dict[tuple, LoRADenseBatch | None] = {}
            for module, module_segments in segments.items():
                key = tuple(
                    (s.start, s.end, s.contiguous_start, s.rank, s.scale) for s in module_segments
                )
                if key not in built:
                    built[key] = self._dense_batch(module_segments, num_tokens)
                if built[key] is not None:
                    dense[module] = built[key]
        return LoRAStep(pools=self, segments=segments, max_rank=max_rank, dense=dense)

    def _kernel_batch(self, spans: list[tuple[int, int, int | None]]) -> LoRABatch:
        """The step as one ``LoRABatch`` whose slices are ``LORA_TARGETS`` in order."""
        table: dict[int, int] = {}  # adapter id -> index in the step's table
        indexed = []
        for start, end, adapter_id in spans:
            index = None if adapter_id is None else table.setdefault(adapter_id, len(table))
            indexed.append((start, end, index))
        residents = [self._resident[adapter_id] for adapter_id in table]
        modules = [[r.modules.get(m, (0, 0.0)) for r in residents] for m in LORA_TARGETS]
        return LoRABatch.build(
            indexed,
            adapter_rows=[r.rows.tolist() for r in residents],
            ranks=[[rank for rank, _ in per_adapter] for per_adapter in modules],
            scales=[[scale for _, scale in per_adapter] for per_adapter in modules],
            num_tokens=spans[-1][1] if spans else 0,
            device=self._device,
        )

    def _dense_batch(self, segments: list[LoRASegment], num_tokens: int) -> LoRADenseBatch | None:
        first = min(seg.contiguous_start for seg in segments)
        last = max(seg.contiguous_start + seg.rank for seg in segments)
        if last - first > DENSE_MAX_ROWS:
            return None
        mask = torch.zeros(num_tokens, last - first, dtype=self._dtype, device=self._device)
        scale = torch.zeros(num_tokens, 1, dtype=self._dtype, device=self._device)
        for seg in segments:
            row = seg.contiguous_start - first
            mask[seg.start : seg.end, row : row + seg.rank] = 1
            scale[seg.start : seg.end] = seg.scale
        return LoRADenseBatch(row_start=first, row_end=last, mask=mask, scale=scale)

    # --- internals -------------------------------------------------------------
    def _find_rows(self, count: int) -> int | None:
        run = 0
        for index, used in enumerate(self._row_used):
            run = 0 if used else run + 1
            if run == count:
                return index - count + 1
        return None

    def _ensure_module(self, module: str) -> None:
        if module in self._a:
            return
        in_f, out_f = self._config.module_shape(module)
        layers = range(self._config.num_layers)
        kw = {"dtype": self._dtype, "device": self._device}
        self._a[module] = [torch.zeros(self._capacity, in_f, **kw) for _ in layers]
        self._b[module] = [torch.zeros(self._capacity, out_f, **kw) for _ in layers]

    def _grow(self, capacity: int) -> None:
        extra = capacity - self._capacity
        for pools in (*self._a.values(), *self._b.values()):
            for layer, pool in enumerate(pools):
                pools[layer] = torch.cat([pool, pool.new_zeros(extra, pool.shape[1])])
        self._row_used.extend(bytes(extra))
        self._capacity = capacity
