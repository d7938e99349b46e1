"""How far putting adapters on the device may take memory from KV: the blocks promised.

Adapter rows and KV blocks share one memory (``pool.py``). An adapter staged for a waiting
request takes KV blocks; if it takes the blocks that running requests still need to finish,
they are preempted and recomputed while their adapters stay pinned, and the next adapter
takes more: the spiral that collapsed S-LoRA's S2 workload with 1,000 adapters (KV squeezed
from 6,133 blocks to 261 by adapters staged for requests that could not run).

So staging is bounded by a promise, S-LoRA's admission rule applied to adapters: a running
request may still grow to its most tokens (prompt plus ``max_tokens``), and so may every
request an adapter is staged for, up to ``PROMISE_HORIZON_TOKENS`` beyond what it has now.
The horizon keeps a chat request without ``max_tokens`` (which may run to the end of the
context, and rarely does) from being promised a whole context: past it, growth is met as
the scheduler meets it, optimistically. An adapter may take only KV memory beyond the blocks
promised (rows beyond come from idle adapters); the scheduler's admission itself stays
optimistic. The promise protects only what a waiting request must not take by the
scheduler's own rules: running requests of a higher priority, of its own tenant, and of
other tenants up to their fair share of KV (by weight, among the tenants with requests).
Blocks of lower priorities, and another tenant's promise beyond its share, are the waiting
request's to claim (scheduler policies 3, 5 and 6): one tenant's flood, or its requests'
huge ``max_tokens``, cannot promise away another tenant's adapter room.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.sequence import Sequence

# How far ahead a request's growth is promised: every output of S-LoRA's workloads (under
# 512 tokens) is promised whole; a request that may run to a long context is promised this.
PROMISE_HORIZON_TOKENS = 512


class KVPromise:
    """KV blocks promised to requests: what adapters being staged may not take."""

    def __init__(
        self,
        kv: KVCacheManager,
        running: Iterable[Sequence],
        candidates: Iterable[Sequence],
        weights: Mapping[str | None, float],
    ):
        self.kv = kv
        # (priority, tenant) -> blocks its running requests hold and may still take.
        self._groups: dict[tuple[int, str | None], int] = defaultdict(int)
        promised: dict[str | None, int] = defaultdict(int)
        for seq in running:
            blocks = max(kv.num_blocks_of(seq.request_id), self.blocks_for(seq))
            self._groups[(seq.priority, seq.tenant)] += blocks
            promised[seq.tenant] += blocks
        active = set(promised) | {seq.tenant for seq in candidates}
        total_weight = sum(weights.get(t, 1.0) for t in active) or 1.0
        # Each tenant's fair share of KV blocks: what its promise is protected up to.
        self._share = {t: kv.limit * weights.get(t, 1.0) / total_weight for t in active}
        self._over_share = {t for t in promised if promised[t] > self._share[t]}
        self.staged = 0  # blocks promised to the candidates passed so far

    def blocks_for(self, seq: Sequence) -> int:
        """Blocks ``seq`` needs at its longest, or ``PROMISE_HORIZON_TOKENS`` past now."""
        tokens = min(seq.max_num_tokens, seq.num_tokens + PROMISE_HORIZON_TOKENS)
        return -(-tokens // self.kv.block_size)

    def protects(self, priority: int, tenant: str | None, seq: Sequence) -> bool:
        """Whether running requests of (``priority``, ``tenant``) keep all their blocks
        against waiting ``seq``; else it may claim them (preempting: policies 3, 5 and 6).
        Another tenant's above its share keeps only its share (``kv_floor``)."""
        if priority != seq.priority:
            return priority > seq.priority
        return tenant == seq.tenant or tenant not in self._over_share

    def kv_floor(self, seq: Sequence) -> int:
        """The lowest KV limit at which the blocks promised against ``seq`` (and its own at
        its longest) stay KV's: held blocks, protected running requests' blocks now and to
        come (another tenant's up to its share), the candidates' before it."""
        protected = 0
        for (priority, tenant), blocks in self._groups.items():
            if self.protects(priority, tenant, seq):
                protected += blocks
            elif priority == seq.priority:  # another tenant above its share: its share
                protected += min(blocks, self._share[tenant])
        protected = round(protected)
        return self.kv.num_held_blocks + protected + self.staged + self.blocks_for(seq)

    def kv_floor_all(self) -> int:
        """The lowest KV limit at which every promise stays KV's (a pinned adapter's
        room): held blocks, every running request's at its longest, the candidates'."""
        running = round(sum(self._groups.values()))
        return self.kv.num_held_blocks + running + self.staged

    def promise(self, seq: Sequence) -> None:
        """``seq`` will be admitted (its adapter is on the device): its blocks are promised."""
        self.staged += self.blocks_for(seq)
