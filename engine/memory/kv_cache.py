"""Paged KV-cache bookkeeping: which physical blocks each request owns, and the prefix cache.

This module holds no tensors. The device arena (``loramux.engine.memory.arena``) owns
the KV tensors, shaped ``[num_blocks, block_size, ...]``; this manager only decides which
block ids a request may write to and read from, and the runner reads those ids through
:meth:`KVCacheManager.block_table`.

Idioms
------
*Check, then commit.* The scheduler asks :meth:`KVCacheManager.can_allocate` before it admits a
request or grows one, and only then calls :meth:`KVCacheManager.allocate`. ``can_allocate``
never over-promises: if it says yes, the ``allocate`` that follows (with nothing in between)
succeeds. ``allocate`` re-checks anyway and raises :class:`BlockPoolExhausted` *before* it
touches any state, so a failed call leaves nothing half-done for the scheduler to undo.

*Ref counts.* A block may sit in several requests' tables at once (a shared prompt prefix,
such as a system prompt). Each table entry holds one reference; a block is "used" while its
ref count is above zero and is never reclaimed then.

*Chained, verified hashes.* A FULL block is identified by ``block_hash(parent_hash, tokens,
salt)``, so a block's hash covers every token before it: the same tokens after a different
prefix have different KV (attention saw a different context) and must not match. Hashes are
64-bit truncations of sha256, so they are stable across processes but can collide; on every
hash hit the stored (parent hash, salt, token ids) are compared with the request's, and a
mismatch is a miss. A collision can therefore cost a cache hit, never correctness.

*Lazy LRU eviction.* When a registered block's ref count drops to zero its KV is kept and it
stays findable; it merely becomes *evictable*. Only when an allocation runs out of truly free
blocks is the least recently freed evictable block reclaimed, and only then is its hash
registration dropped. Evictable blocks count as free for admission, since taking one is
always possible. A request's blocks are released tail first, so within one request the later
blocks are evicted before the earlier ones; the heads of prefixes, which the most requests
share, survive the longest.

*A movable limit.* The KV tensors are shared with the resident LoRA adapters (S-LoRA's
unified paging, see ``loramux.engine.memory.arena``): KV blocks are handed out from
the bottom, adapter rows live at the top of the same memory. Only blocks ``[0, limit)`` are
KV's; the adapter pool moves the limit with :meth:`KVCacheManager.try_lower_limit` (which
succeeds only when every block it takes is free or evictable) and
:meth:`KVCacheManager.raise_limit`. Free blocks are handed out lowest id first (a heap), so
in-use blocks gather at the bottom and the top stays free for adapters to take. The limit
never goes below ``min_limit``, the blocks one request of the maximum length needs: every
admitted request can always run to completion alone. Accounting (``num_free_blocks``,
``usage``, admission) is relative to the limit; ``num_blocks`` stays the physical count.

*Holding blocks for an adapter.* An adapter that does not fit needs the blocks at the top
of KV's range, and in-use blocks sit anywhere once the prefix cache recycles blocks. So
:meth:`KVCacheManager.hold_from` marks blocks ``[hold, limit)`` as wanted by the adapter
pool: they are no longer handed out, and each one its request releases is *held* (neither
free nor evictable) instead of going back to a pool, until the range is free and the pool
takes it, or :meth:`KVCacheManager.release_hold` gives it back. Held blocks count as
neither free nor used. Blocks still in use there need not wait for their requests to
end: :meth:`KVCacheManager.move_out_of_hold` gives each a free block below the hold
(tables, ref counts and prefix-cache registration follow) and returns the moves, whose
contents the caller copies before the next step reads them; only what finds no free
block below (``hold_shortfall``) waits, or is preempted by the scheduler.

*Blocks out of a sliding window.* When every layer attends over the last ``window`` keys
only (``window``: a Mistral-style model), keys more than ``window - 1`` positions before a
request's next token are never read again: :meth:`KVCacheManager.commit` releases the
request's blocks that lie wholly before them, head first, as the request advances. Their
table entries stay, pointing at the request's first live block, so positions keep their
places and any read of them (the torch attention gathers whole contexts, masking what is
out of the window) lands on the request's own KV; only the live entries hold refs.

*Salt = adapter id + tenant.* KV depends on the weights that produced it, so a prompt run
under adapter A must not reuse KV computed under adapter B; and one tenant must not be able
to detect (through timing) what another tenant has recently sent. The caller therefore passes
a salt such as ``(adapter_id, tenant_salt)``; it is mixed into every block's hash and stored
for verification, so identical tokens under different salts never share blocks.
"""

from __future__ import annotations

import hashlib
import heapq
import sys
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["BlockPoolExhausted", "CachedPrefix", "KVCacheManager", "block_hash"]


class BlockPoolExhausted(RuntimeError):
    """Not enough free or evictable blocks for the requested allocation."""


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------


def _encode_salt(salt: object) -> bytes:
    """A stable, unambiguous byte encoding of a salt built from None/bool/int/str/bytes/tuples.

    ``repr`` or ``pickle`` are not used: ``repr`` of arbitrary objects can embed memory
    addresses, which would silently make hashes differ between processes. Every item is tagged
    with its type and length-prefixed, so ``("ab", "c")`` and ``("a", "bc")`` or ``1`` and
    ``"1"`` encode differently.
    """
    if salt is None:
        return b"N"
    if isinstance(salt, bool):  # before int: bool is an int subclass
        return b"T" if salt else b"F"
    if isinstance(salt, int):
        text = str(salt).encode()
        return b"I" + len(text).to_bytes(4, "little") + text
    if isinstance(salt, str):
        data = salt.encode("utf-8", "surrogatepass")
        return b"S" + len(data).to_bytes(4, "little") + data
    if isinstance(salt, bytes):
        return b"B" + len(salt).to_bytes(4, "little") + salt
    if isinstance(salt, tuple):
        parts = [b"(", len(salt).to_bytes(4, "little")]
        parts.extend(_encode_salt(item) for item in salt)
        parts.append(b")")
        return b"".join(parts)
    raise TypeError(
        f"salt must be built from None, bool, int, str, bytes and tuples, got {type(salt).__name__}"
    )


def block_hash(parent: int | None, tokens: Sequence[int], salt: Hashable) -> int:
    """Chained 64-bit hash of one full block: parent block's hash, the token ids and the salt.

    sha256 rather than Python's ``hash()``, whose str hashing is randomized per process; a
    stable hash lets a cache key mean the same thing in every worker and across restarts.
    """
    h = hashlib.sha256()
    # A tag byte keeps "no parent" distinct from any 64-bit parent value.
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(_encode_salt(salt))
    packed = array("q", tokens)
    if sys.byteorder != "little":  # fix the byte order so the hash is host independent
        packed.byteswap()
    h.update(len(packed).to_bytes(4, "little"))
    h.update(packed.tobytes())
    return int.from_bytes(h.digest()[:8], "little")


# ---------------------------------------------------------------------------------------------
# Manager
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedPrefix:
    """Result of :meth:`KVCacheManager.find_cached_prefix`; pass it on to ``can_allocate`` and
    ``allocate``.

    ``block_ids`` are the physical blocks that already hold the KV of the first ``num_tokens``
    tokens (always a whole number of blocks). The handle is only valid until the next call
    that changes the manager's state: look up, check and allocate back to back.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    # The hash each block was found under; allocate() checks them to detect a stale handle
    # (a block evicted and reused after the lookup) and seeds the request's hash chain with them.
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    # How many tokens the lookup was asked about, for the prefix-cache hit-rate stats.
    num_query_tokens: int = 0


_EMPTY_PREFIX = CachedPrefix()


class KVCacheManager:
    """Block allocator with ref counts, a chained-hash prefix cache and a movable limit.

    See the module docstring. ``num_blocks`` is the physical block count; ``limit`` (starting
    at ``num_blocks``) the blocks KV may use now, never below ``min_limit``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        min_limit: int = 1,
        window: int | None = None,
    ):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 1 <= min_limit <= num_blocks:
            raise ValueError(f"min_limit must be in [1, {num_blocks}], got {min_limit}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.min_limit = min_limit
        self.window = window  # every layer's sliding window (None: keys are kept)
        self._limit = num_blocks

        # Per-block state, indexed by block id.
        self._ref_count = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # registered hash, if any
        # (parent hash, salt, token ids) the block was registered with, to verify hash hits.
        self._key: list[tuple[int | None, Hashable, tuple[int, ...]] | None] = [None] * num_blocks

        # ref 0, holding nothing worth keeping; taken first, lowest id first (a min-heap: a
        # sorted list is one). Holds only blocks below the limit, as does _evictable.
        self._free: list[int] = list(range(num_blocks))
        # ref 0 but registered in the prefix cache; insertion order = order freed, so the first
        # item is the least recently used one. OrderedDict gives O(1) removal from the middle
        # when a prefix hit revives a block.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}

        self._tables: dict[str, list[int]] = {}
        # The chained hash of each of the request's full blocks committed so far (or received
        # as a cached prefix): the parent for the next block, and how far commit() has got.
        self._chain: dict[str, list[int]] = {}
        # How many of the request's leading table entries are released (out of the window).
        self._released: dict[str, int] = {}
        self.blocks_released = 0  # blocks released out of the window so far

        self.prefix_cache_queries = 0  # tokens looked up, counted when a request is admitted
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

        # Blocks [hold, limit) are wanted by the adapter pool (None: no hold); the ones with
        # ref 0 wait in _held, out of both pools (see the module docstring).
        self._hold: int | None = None
        self._held: set[int] = set()

    # -- accounting -------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Blocks ``[0, limit)`` are KV's now; the rest of the memory holds adapter rows."""
        return self._limit

    @property
    def num_free_blocks(self) -> int:
        """Blocks below the limit an allocation could take now: truly free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self._limit - self.num_free_blocks - len(self._held)

    @property
    def hold(self) -> int | None:
        """Where the adapter pool's hold starts (blocks ``[hold, limit)``), or None."""
        return self._hold

    @property
    def num_held_blocks(self) -> int:
        """Blocks in the hold that no request uses any more (waiting for the pool)."""
        return len(self._held)

    def usage(self) -> float:
        """Share of the blocks KV may use now (below the limit) that requests hold."""
        return self.num_used_blocks / self._limit

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil division

    # -- prefix lookup ----------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int], salt: Hashable) -> CachedPrefix:
        """Longest verified run of cached full blocks at the start of ``token_ids``.

        Capped at ``len(token_ids) - 1`` tokens (rounded down to whole blocks): the model must
        compute at least one token to produce the logits for the next one. Read-only.
        """
        n = len(token_ids)
        if not self.enable_prefix_caching or n == 0:
            return CachedPrefix(num_query_tokens=n)
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range((n - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, salt)
            bid = self._hash_to_block.get(h)
            # Verify: a 64-bit hash can collide, and a false hit would serve another
            # sequence's (or another tenant's) KV.
            if bid is None or self._key[bid] != (parent, salt, tokens):
                break
            block_ids.append(bid)
            hashes.append(h)
            parent = h
        return CachedPrefix(
            block_ids=tuple(block_ids),
            num_tokens=len(block_ids) * bs,
            block_hashes=tuple(hashes),
            num_query_tokens=n,
        )

    def _check_prefix(self, prefix: CachedPrefix) -> None:
        """Reject a handle whose blocks were evicted (and possibly reused) since the lookup."""
        if len(prefix.block_hashes) != len(prefix.block_ids) or any(
            self._hash[bid] != h
            for bid, h in zip(prefix.block_ids, prefix.block_hashes, strict=True)
        ):
            raise ValueError(
                "stale CachedPrefix: its blocks changed since find_cached_prefix(); "
                "look up, check and allocate back to back"
            )

    # -- allocation -------------------------------------------------------------------------

    def _plan(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None
    ) -> tuple[tuple[int, ...], int, bool]:
        """(prefix blocks to take refs on, fresh blocks needed, whether that is possible)."""
        table = self._tables.get(request_id)
        if table is not None:
            # The prefix only matters when a request is first admitted.
            prefix_ids: tuple[int, ...] = ()
            have = len(table)
        else:
            if prefix is not None and prefix.block_ids:
                self._check_prefix(prefix)
                prefix_ids = prefix.block_ids
            else:
                prefix_ids = ()
            have = len(prefix_ids)
        fresh = max(0, self._blocks_for(num_tokens) - have)
        # A cached prefix block with ref 0 is counted in num_free_blocks, but taking a ref on it
        # removes it from the pool, so it is no longer available for the fresh blocks.
        revived = sum(1 for bid in prefix_ids if self._ref_count[bid] == 0)
        return prefix_ids, fresh, fresh + revived <= self.num_free_blocks

    def can_allocate(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Whether ``allocate(request_id, num_tokens, prefix)`` would succeed now."""
        return self._plan(request_id, num_tokens, prefix)[2]

    def allocate(
        self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None
    ) -> None:
        """Grow the request's table to cover ``num_tokens`` tokens in total.

        On a request's first call, takes a ref on each ``prefix`` block first (later calls
        ignore ``prefix``). Raises :class:`BlockPoolExhausted`, with no state changed, if the
        pool cannot supply the blocks.
        """
        prefix_ids, fresh, ok = self._plan(request_id, num_tokens, prefix)
        if not ok:
            raise BlockPoolExhausted(
                f"request {request_id!r} needs {fresh} new blocks for {num_tokens} tokens "
                f"(+{len(prefix_ids)} prefix blocks); {self.num_free_blocks} free"
            )
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = []
            self._chain[request_id] = list(prefix.block_hashes) if prefix_ids else []
            # Refs on the prefix go first, so the fresh allocations below cannot evict them.
            for bid in prefix_ids:
                self._take_ref(bid)
            table.extend(prefix_ids)
            # Counted here rather than in the lookup, so a lookup that is then not admitted
            # (and repeated next step) is not counted twice.
            if prefix is not None:
                self.prefix_cache_queries += prefix.num_query_tokens
                self.prefix_cache_hits += prefix.num_tokens
        for _ in range(fresh):
            table.append(self._pop_block())

    def _take_ref(self, bid: int) -> None:
        if self._ref_count[bid] == 0:
            # Only registered blocks can be found by a lookup, and a registered block with ref 0
            # always lives in the evictable set.
            del self._evictable[bid]
        self._ref_count[bid] += 1

    def _pop_block(self) -> int:
        if self._free:
            bid = heapq.heappop(self._free)
        else:
            # Reclaim the least recently freed cached block; its KV is about to be overwritten,
            # so it must stop matching lookups now.
            bid, _ = self._evictable.popitem(last=False)
            self._unregister(bid)
        self._ref_count[bid] = 1
        return bid

    def _unregister(self, bid: int) -> None:
        h = self._hash[bid]
        if h is not None:
            del self._hash_to_block[h]
            self._hash[bid] = None
            self._key[bid] = None

    # -- queries ----------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in token order (a copy)."""
        return list(self._tables[request_id])

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds (0 for one holding none; released ones not counted)."""
        table = self._tables.get(request_id)
        return 0 if table is None else len(table) - self._released.get(request_id, 0)

    # -- prefix registration ----------------------------------------------------------------

    def commit(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: Hashable
    ) -> None:
        """Register the request's blocks that are full of computed KV in the prefix cache.

        ``token_ids`` are the request's tokens so far (prompt + generated); KV exists for the
        first ``num_computed`` of them. Blocks already handled for this request are skipped, so
        calling this every step costs only the newly filled blocks. Under a sliding
        ``window``, then releases the blocks out of it (see the module docstring).
        """
        if self.enable_prefix_caching:
            self._register(request_id, token_ids, num_computed, salt)
        if self.window is not None:
            self._release_before(request_id, num_computed - self.window + 1)

    def _register(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: Hashable
    ) -> None:
        table = self._tables[request_id]
        chain = self._chain[request_id]
        bs = self.block_size
        num_full = min(min(num_computed, len(token_ids)) // bs, len(table))
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, salt)
            # The chain advances even when the block is not registered below, since the
            # following blocks' hashes depend on it.
            chain.append(h)
            bid = table[i]
            if h in self._hash_to_block or self._hash[bid] is not None:
                # Another block already serves this content (two requests computed the same
                # prefix concurrently): keep that one. Ours stays unregistered and goes
                # straight back to the free list when released.
                continue
            self._hash[bid] = h
            self._key[bid] = (parent, salt, tokens)
            self._hash_to_block[h] = bid

    # -- release ----------------------------------------------------------------------------

    def _release_before(self, request_id: str, first_needed: int) -> None:
        """Release the request's blocks wholly before token ``first_needed`` (its last block
        stays), re-pointing their entries at its first live block."""
        table = self._tables[request_id]
        done = self._released.get(request_id, 0)
        upto = min(max(first_needed, 0) // self.block_size, len(table) - 1)
        if upto <= done:
            return
        for index in range(done, upto):
            self._drop_ref(table[index])
        self.blocks_released += upto - done
        table[:upto] = [table[upto]] * upto
        self._released[request_id] = upto

    def free(self, request_id: str) -> None:
        """Drop the request's refs. Unknown request ids are ignored (e.g. aborted before
        admission)."""
        table = self._tables.pop(request_id, None)
        self._chain.pop(request_id, None)
        released = self._released.pop(request_id, 0)
        if table is None:
            return
        # Tail first: blocks become evictable in this order, so the tail is evicted first and the
        # prefix head, most likely to be shared by later requests, stays cached longest.
        for bid in reversed(table[released:]):
            self._drop_ref(bid)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks ``num_tokens`` tokens need.

        Speculative decoding allocates slots for proposed tokens; those it rejected leave
        blocks past the request's tokens, whose KV is never read (a later step writes over
        it) and was never registered (only blocks full of computed tokens are). Unknown
        request ids are ignored."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = max(self._blocks_for(num_tokens), len(self._chain[request_id]))
        while len(table) > keep:
            self._drop_ref(table.pop())

    def _drop_ref(self, bid: int) -> None:
        self._ref_count[bid] -= 1
        if self._ref_count[bid] == 0:
            if self._hold is not None and bid >= self._hold:
                self._unregister(bid)  # the pool will overwrite it
                self._held.add(bid)
            elif self._hash[bid] is not None:
                self._evictable[bid] = None  # appended = most recently used
            else:
                heapq.heappush(self._free, bid)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: evictable ones become truly free, and blocks still in use
        are unregistered (so they are no longer found, and are freed outright on release)."""
        for bid in self._evictable:
            self._unregister(bid)
            heapq.heappush(self._free, bid)
        self._evictable.clear()
        for bid in list(self._hash_to_block.values()):
            self._unregister(bid)

    # -- the limit -------------------------------------------------------------------------

    def lowest_possible_limit(self) -> int:
        """The lowest limit :meth:`try_lower_limit` would accept now: no block at or above it
        is in use, and it is not below ``min_limit``. O(limit)."""
        low = self._limit
        while low > self.min_limit and self._ref_count[low - 1] == 0:
            low -= 1
        return low

    def hold_from(self, hold: int) -> None:
        """Stop handing out blocks ``[hold, limit)`` and keep each as it is released, for the
        adapter pool to take (see the module docstring). Cached blocks there leave the prefix
        cache. ``hold`` is raised to ``min_limit`` if below it; at or above the limit, or the
        same hold as now, it changes nothing."""
        hold = max(hold, self.min_limit)
        if hold >= self._limit or hold == self._hold:
            return
        self.release_hold()
        self._hold = hold
        kept = [bid for bid in self._free if bid < hold]
        self._held.update(bid for bid in self._free if bid >= hold)
        self._free = kept
        heapq.heapify(self._free)
        for bid in [bid for bid in self._evictable if bid >= hold]:
            del self._evictable[bid]
            self._unregister(bid)
            self._held.add(bid)

    @property
    def hold_shortfall(self) -> int:
        """Blocks in use in the hold beyond what :meth:`move_out_of_hold` could move now."""
        if self._hold is None:
            return 0
        in_use = sum(1 for bid in range(self._hold, self._limit) if self._ref_count[bid])
        return max(0, in_use - self.num_free_blocks)

    def move_out_of_hold(self) -> list[tuple[int, int]]:
        """Move blocks in use in the hold to free blocks below it, as far as there are any;
        returns the moves ``(src, dst)``. Bookkeeping only: the caller copies each block's
        KV from ``src`` to ``dst`` before it is read again. ``src`` is then held."""
        if self._hold is None:
            return []
        in_hold = [bid for bid in range(self._hold, self._limit) if self._ref_count[bid]]
        if not in_hold:
            return []
        places: dict[int, list[tuple[list[int], int]]] = {bid: [] for bid in in_hold}
        for table in self._tables.values():
            for index, bid in enumerate(table):
                if bid in places:
                    places[bid].append((table, index))
        moves = []
        for src in in_hold:
            if not self.num_free_blocks:
                break
            dst = self._pop_block()  # below the hold: nothing at or above it is pooled
            self._ref_count[dst] = self._ref_count[src]
            self._ref_count[src] = 0
            for table, index in places[src]:
                table[index] = dst
            h = self._hash[src]
            if h is not None:  # the cached content moves with it
                self._hash[dst], self._key[dst] = h, self._key[src]
                self._hash_to_block[h] = dst
                self._hash[src] = self._key[src] = None
            self._held.add(src)
            moves.append((src, dst))
        return moves

    def release_hold(self) -> None:
        """Give the held blocks back to the free pool and hand out the whole range again."""
        for bid in self._held:
            heapq.heappush(self._free, bid)
        self._held.clear()
        self._hold = None

    def try_lower_limit(self, new_limit: int) -> bool:
        """Hand blocks ``[new_limit, limit)`` over (to the adapter pool); False if impossible.

        Succeeds only if ``new_limit >= min_limit`` and every block in the range is truly free
        or evictable; evictable ones leave the prefix cache (their KV is about to be
        overwritten). A refusal changes nothing. ``new_limit == limit`` is a no-op success.
        """
        if new_limit > self._limit:
            raise ValueError(f"new limit {new_limit} is above the limit {self._limit}")
        if new_limit < self.min_limit:
            return False
        taken = range(new_limit, self._limit)
        if any(self._ref_count[bid] for bid in taken):
            return False
        for bid in taken:
            if bid in self._evictable:
                del self._evictable[bid]
                self._unregister(bid)
            self._held.discard(bid)
        if taken:
            self._free = [bid for bid in self._free if bid < new_limit]
            heapq.heapify(self._free)
        self._limit = new_limit
        if self._hold is not None and self._hold >= new_limit:
            self.release_hold()  # the pool has what it held for (held is empty now)
        return True

    def raise_limit(self, new_limit: int) -> None:
        """Take blocks ``[limit, new_limit)`` back as truly free (their old contents are garbage
        to KV: they are unregistered, and a block is written before it is read)."""
        if not self._limit <= new_limit <= self.num_blocks:
            raise ValueError(f"new limit {new_limit} must be in [{self._limit}, {self.num_blocks}]")
        for bid in range(self._limit, new_limit):
            if self._hold is not None and bid >= self._hold:
                self._held.add(bid)
            else:
                heapq.heappush(self._free, bid)
        self._limit = new_limit

    # -- debugging --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the internal structures agree with each other (for tests; O(num_blocks))."""
        assert self.min_limit <= self._limit <= self.num_blocks, "limit out of range"
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            released = self._released.get(request_id, 0)
            for bid in table[released:]:
                refs[bid] += 1
            assert all(bid == table[released] for bid in table[:released]), "stale entry"
        assert refs == self._ref_count, "ref counts disagree with block tables"
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "duplicate in free list"
        assert not free & evictable, "block both free and evictable"
        heap = self._free
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "free not a heap"
        for bid in range(self._limit, self.num_blocks):
            # Above the limit the memory is the adapter pool's: no KV state may point there.
            assert refs[bid] == 0, f"block {bid} above the limit is in use"
            assert bid not in free and bid not in evictable, f"block {bid} above limit pooled"
            assert self._hash[bid] is None, f"block {bid} above the limit is registered"
        held = self._held
        assert all(self._hold is not None and self._hold <= bid < self._limit for bid in held), (
            "a held block outside the hold"
        )
        for bid in range(self._limit):
            if refs[bid] == 0:
                places = (bid in free) + (bid in evictable) + (bid in held)
                assert places == 1, f"block {bid} lost or in two places"
                if self._hold is not None and bid >= self._hold:
                    assert bid in held, f"released block {bid} in the hold not held"
            else:
                assert bid not in free and bid not in evictable and bid not in held, (
                    f"used block {bid} in a pool"
                )
            if bid in free:
                assert self._hash[bid] is None, f"free block {bid} still registered"
            if bid in evictable:
                assert self._hash[bid] is not None, f"evictable block {bid} not registered"
        for h, bid in self._hash_to_block.items():
            assert self._hash[bid] == h, f"hash index disagrees for block {bid}"
        assert sum(h is not None for h in self._hash) == len(self._hash_to_block)
        if not self.enable_prefix_caching:
            assert not self._hash_to_block, "block registered with prefix caching disabled"
