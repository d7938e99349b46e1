"""Which engine serves a request: adapter affinity within a bound on imbalance.

Among the live engines serving the request's base model (``candidates``), an engine is
*eligible* while one more request keeps it within ``load_factor`` of the mean load
("consistent hashing with bounded loads", applied to affinity):

    load_e + 1 <= ceil(load_factor * (total + 1) / n)

so no engine piles up work while others idle, whatever the adapter popularity. Among the
eligible, prefer (in order) the engine whose device memory holds the adapter, then one
with it warm in host RAM, then one this platform already sent it to (so an adapter's
requests stick to one engine before its heartbeat reports the adapter resident), then any;
ties go to the least loaded, then to the engine that ranks first for the request's key
(the adapter's name, or the request id without one) by rendezvous hashing: idle engines
split new adapters evenly and deterministically, and every platform replica agrees. With no eligible engine
(only possible through rounding) the least loaded takes it.

Pure functions over plain values: the client supplies the loads it knows (the registry's,
raised by its own requests in flight since).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    engine_id: str
    load: int  # requests running or waiting on it, as best known
    holds_on_device: bool = False
    holds_in_host: bool = False
    sent_before: bool = False  # this platform registered the adapter there


def load_cap(loads: list[int], load_factor: float) -> int:
    """The most requests an engine may hold after taking one more."""
    if not loads:
        return 0
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


COLD = 3  # the affinity of an engine that has nothing of the adapter


def affinity(candidate: Candidate) -> int:
    """Lower is better: 0 on the device, 1 warm in host RAM, 2 sent before, COLD none."""
    if candidate.holds_on_device:
        return 0
    if candidate.holds_in_host:
        return 1
    if candidate.sent_before:
        return 2
    return COLD


def rendezvous_rank(key: str, engine_id: str) -> str:
    """Where ``engine_id`` ranks for ``key`` (lowest first): a stable hash of both."""
    return hashlib.sha256(f"{key}\x00{engine_id}".encode()).hexdigest()


def choose(candidates: list[Candidate], load_factor: float, key: str) -> Candidate | None:
    """The engine for one request, by the module docstring's rules; None if no candidate.

    ``key`` breaks ties: the adapter's name (so its requests agree), else the request id.
    """
    if not candidates:
        return None
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    cap = load_cap([c.load for c in candidates], load_factor)
    eligible = [c for c in candidates if c.load + 1 <= cap]
    if not eligible:  # rounding left none: the least loaded takes it
        return min(candidates, key=lambda c: (c.load, rendezvous_rank(key, c.engine_id)))
    return min(eligible, key=lambda c: (affinity(c), c.load, rendezvous_rank(key, c.engine_id)))
