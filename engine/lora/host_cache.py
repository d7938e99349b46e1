"""The host-RAM tier of adapter residency: parsed adapters kept on the CPU, LRU, bounded.

Rules:

- Entries are :class:`LoRAWeights` on the CPU (pinned by the loader when the engine
  runs on CUDA); their size is the bytes of all their tensors (:func:`weights_nbytes`).
- ``put`` inserts as most recently used and evicts least recently used entries until
  the total fits ``max_bytes``; ``get`` marks an entry most recently used.
- A pinned entry (refcounted ``pin`` / ``unpin``; the engine pins while it copies to
  the device) is never evicted and cannot be removed. If the unpinned entries cannot
  make room, ``put`` raises :class:`HostCacheFull` and changes nothing.
- An adapter larger than the whole budget raises ``ValueError``: it can never be held.

Not thread-safe, by design: the engine thread is the only caller (the background
loader hands its results back through a queue the engine polls).
"""

from __future__ import annotations

from collections import OrderedDict

from loramux.engine.lora.adapter import LoRAWeights


def weights_nbytes(weights: LoRAWeights) -> int:
    """Bytes of all of an adapter's tensors: A, B, DoRA's magnitudes and the embedding's
    and head's rows (once when the two share them)."""
    tables = {id(t): t.rows.nbytes for t in (weights.embed, weights.head) if t is not None}
    return sum(tables.values()) + sum(
        tensor.nbytes
        for module in weights.modules.values()
        for tensors in (module.a, module.b, module.magnitude)
        for tensor in tensors.values()
    )


class HostCacheFull(RuntimeError):
    """No room can be made: the unpinned entries are too few to free enough bytes."""


class HostAdapterCache:
    """The host-RAM tier: loaded adapters in LRU order, bounded in bytes."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"host cache max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        # adapter id -> (weights, nbytes), least recently used first
        self._entries: OrderedDict[int, tuple[LoRAWeights, int]] = OrderedDict()
        self._pins: dict[int, int] = {}  # adapter id -> pin count (> 0 only)
        self._bytes_used = 0
        self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[int]:
        """Adapter ids, least recently used first."""
        return list(self._entries)

    def get(self, adapter_id: int) -> LoRAWeights | None:
        """The adapter's weights, marked most recently used; None if not held."""
        entry = self._entries.get(adapter_id)
        if entry is None:
            return None
        self._entries.move_to_end(adapter_id)
        return entry[0]

    def put(self, adapter_id: int, weights: LoRAWeights) -> list[int]:
        """Hold ``weights`` as most recently used; returns the ids evicted to make room.

        Replacing an entry keeps its pins. Raises ``ValueError`` if the adapter alone
        exceeds the budget and :class:`HostCacheFull` if pinned entries leave too little
        room; in both cases nothing is inserted or evicted.
        """
        nbytes = weights_nbytes(weights)
        if nbytes > self._max_bytes:
            raise ValueError(
                f"adapter {weights.name!r} needs {nbytes} bytes of host memory, more than "
                f"the whole host adapter cache ({self._max_bytes} bytes)"
            )
        old = self._entries.get(adapter_id)
        used = self._bytes_used - (old[1] if old is not None else 0)
        # Plan the evictions first, so a put that cannot fit changes nothing.
        victims: list[int] = []
        for other, (_, other_bytes) in self._entries.items():
            if used + nbytes <= self._max_bytes:
                break
            if other == adapter_id or other in self._pins:
                continue
            victims.append(other)
            used -= other_bytes
        if used + nbytes > self._max_bytes:
            pinned = sum(self._entries[i][1] for i in self._pins if i != adapter_id)
            raise HostCacheFull(
                f"adapter {weights.name!r} needs {nbytes} bytes of host memory; "
                f"{pinned} of the cache's {self._max_bytes} bytes are pinned"
            )
        for victim in victims:
            self._bytes_used -= self._entries.pop(victim)[1]
        self.evictions += len(victims)
        if old is not None:
            self._bytes_used -= old[1]
        self._entries[adapter_id] = (weights, nbytes)
        self._entries.move_to_end(adapter_id)
        self._bytes_used += nbytes
        return victims

    def pin(self, adapter_id: int) -> None:
        """Keep the entry from eviction until a matching ``unpin``; KeyError if not held."""
        if adapter_id not in self._entries:
            raise KeyError(f"adapter {adapter_id} is not in the host cache")
        self._pins[adapter_id] = self._pins.get(adapter_id, 0) + 1

    def unpin(self, adapter_id: int) -> None:
        """Undo one ``pin``; ValueError if the entry is not pinned."""
        count = self._pins.get(adapter_id, 0)
        if count == 0:
            raise ValueError(f"adapter {adapter_id} is not pinned in the host cache")
        if count == 1:
            del self._pins[adapter_id]
        else:
            self._pins[adapter_id] = count - 1

    def is_pinned(self, adapter_id: int) -> bool:
        return adapter_id in self._pins

    def remove(self, adapter_id: int) -> bool:
        """Drop the entry; False if it was not held. ValueError if it is pinned."""
        if adapter_id in self._pins:
            raise ValueError(
                f"adapter {adapter_id} is pinned in the host cache (being copied); unpin first"
            )
        entry = self._entries.pop(adapter_id, None)
        if entry is None:
            return False
        self._bytes_used -= entry[1]
        return True
