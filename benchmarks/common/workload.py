"""S-LoRA-style synthetic workloads: seeded, reproducible, and saved alongside results.

A :class:`WorkloadSpec` describes a workload; :func:`generate` turns it into a list of
:class:`WorkloadRequest`. The rules:

- Determinism: the same spec (seed included) always yields the same requests. Every draw
  comes from one ``numpy.random.Generator(PCG64(seed))`` in a fixed order (gaps, base-model
  coin flips, adapters, prompt lengths, output lengths, tenants), each drawn for all
  requests at once, so changing one field's value does not shift another field's draws.
- Arrivals: inter-arrival gaps are Gamma(shape = 1/cv², scale = cv²/rate): mean 1/rate and
  coefficient of variation ``cv`` (cv = 1 is a Poisson process, cv > 1 is burstier).
  Request i arrives at the sum of the first i+1 gaps, so arrivals are sorted and the first
  one is at its own gap from 0.
- Adapters: with probability ``base_fraction`` a request goes to the base model
  (``adapter is None``); otherwise its adapter index in ``0..num_adapters-1`` follows
  ``popularity``:

  * ``"uniform"``: every adapter equally likely;
  * ``"zipf"``: P(k) ∝ 1/(k+1)^s with s = ``popularity_param`` (adapter 0 most popular);
  * ``"power"``: S-LoRA's scheme, k = floor(x · num_adapters) with
    x ~ ``Generator.power(alpha)`` (density alpha·x^(alpha-1) on [0, 1]), alpha =
    ``popularity_param``; alpha = 1 is uniform, alpha < 1 favours low indices.
  * ``"distinct"``: request i uses adapter i mod ``num_adapters`` (``popularity_param``
    unused), so with ``num_requests <= num_adapters`` every request has its own adapter
    (Punica's "distinct" case). The uniform draws are still made and discarded, so the
    later fields' draws match those of any other popularity.

- Ranks: adapter k has rank ``ranks[k % len(ranks)]``.
- Lengths: prompt lengths come from ``input_lens`` when it is non-empty (each request picks
  one of its values uniformly), otherwise uniformly from the inclusive range
  ``input_len = (lo, hi)``. Output lengths likewise from ``output_lens`` / ``output_len``.
- Tenants: each request's tenant is drawn independently of its adapter, with probability
  proportional to the tenant's ``share``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

POPULARITIES = ("uniform", "zipf", "power", "distinct")


@dataclass(frozen=True)
class TenantSpec:
    """One tenant sending part of the workload.

    ``priority`` is 0-9, higher served first (the platform's scale); ``weight`` is the
    fair-share weight within a priority class (> 0); ``share`` is the relative fraction of
    the requests this tenant sends (> 0, normalised over all tenants).
    """

    name: str
    priority: int = 5
    weight: float = 1.0
    share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tenant name must be a non-empty string, got {self.name!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(
                f"tenant {self.name!r}: priority must be an int, got {self.priority!r}"
            )
        if not 0 <= self.priority <= 9:
            raise ValueError(f"tenant {self.name!r}: priority must be in 0..9, got {self.priority}")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if not self.share > 0:
            raise ValueError(f"tenant {self.name!r}: share must be > 0, got {self.share}")


def _check_range(name: str, value: tuple[int, ...]) -> None:
    if len(value) != 2:
        raise ValueError(f"{name} must be a (lo, hi) pair, got {value!r}")
    lo, hi = value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= lo <= hi, got {value!r}")


def _check_choices(name: str, value: tuple[int, ...]) -> None:
    if any(length < 1 for length in value):
        raise ValueError(f"{name} must hold lengths >= 1, got {value!r}")


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload; see the module docstring for how each field is used.

    Rules checked on construction: ``num_requests >= 1``; ``rate > 0``; ``cv > 0``;
    ``num_adapters >= 0`` (0 only with ``base_fraction == 1``); ``popularity`` one of
    ``POPULARITIES`` with ``popularity_param > 0``; ``ranks`` non-empty, each >= 1;
    ``input_len`` / ``output_len`` an inclusive ``(lo, hi)`` with ``1 <= lo <= hi``;
    ``input_lens`` / ``output_lens`` (when non-empty, used instead of the range) each >= 1;
    ``0 <= base_fraction <= 1``; ``tenants`` non-empty with unique names; ``seed >= 0``.
    Sequence fields given as lists are stored as tuples.
    """

    num_requests: int
    rate: float
    cv: float = 1.0
    num_adapters: int = 1
    popularity: str = "uniform"
    popularity_param: float = 1.0
    ranks: tuple[int, ...] = (8,)
    input_len: tuple[int, int] = (8, 512)
    input_lens: tuple[int, ...] = ()
    output_len: tuple[int, int] = (8, 512)
    output_lens: tuple[int, ...] = ()
    base_fraction: float = 0.0
    tenants: tuple[TenantSpec, ...] = (TenantSpec("default"),)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("ranks", "input_len", "input_lens", "output_len", "output_lens"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "tenants", tuple(self.tenants))
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.cv > 0:
            raise ValueError(f"cv must be > 0, got {self.cv}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be in [0, 1], got {self.base_fraction}")
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.num_adapters == 0 and self.base_fraction != 1.0:
            raise ValueError("num_adapters == 0 needs base_fraction == 1 (all base-model)")
        if self.popularity not in POPULARITIES:
            raise ValueError(f"popularity must be one of {POPULARITIES}, got {self.popularity!r}")
        if not self.popularity_param > 0:
            raise ValueError(f"popularity_param must be > 0, got {self.popularity_param}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"ranks must be non-empty with each rank >= 1, got {self.ranks!r}")
        _check_range("input_len", self.input_len)
        _check_range("output_len", self.output_len)
        _check_choices("input_lens", self.input_lens)
        _check_choices("output_lens", self.output_lens)
        if not self.tenants:
            raise ValueError("tenants must not be empty")
        for tenant in self.tenants:
            if not isinstance(tenant, TenantSpec):
                raise ValueError(f"tenants must be TenantSpec values, got {tenant!r}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (tuples as lists, tenants as dicts); ``from_json`` inverts it."""
        raw = dataclasses.asdict(self)
        for name, value in raw.items():
            if isinstance(value, tuple):
                raw[name] = list(value)
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WorkloadSpec:
        """Rebuild a spec from ``to_json``'s dict; unknown keys are a ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown WorkloadSpec fields: {unknown}")
        fields = dict(raw)
        if "tenants" in fields:
            fields["tenants"] = tuple(TenantSpec(**t) for t in fields["tenants"])
        return cls(**fields)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    ``arrival_s`` is seconds from the start of the run; ``adapter`` is an adapter index in
    ``0..num_adapters-1`` or None for the base model.
    """

    index: int
    arrival_s: float
    adapter: int | None
    prompt_len: int
    output_len: int
    tenant: str


def adapter_ranks(spec: WorkloadSpec) -> list[int]:
    """The rank of each adapter: adapter k has ``spec.ranks[k % len(spec.ranks)]``."""
    return [spec.ranks[k % len(spec.ranks)] for k in range(spec.num_adapters)]


def _draw_adapters(spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    n, size = spec.num_adapters, spec.num_requests
    if spec.popularity in ("uniform", "distinct"):
        drawn = rng.integers(0, n, size=size)
        return drawn if spec.popularity == "uniform" else np.arange(size) % n
    if spec.popularity == "zipf":
        weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** spec.popularity_param
        return rng.choice(n, size=size, p=weights / weights.sum())
    # "power": S-LoRA maps x in [0, 1] to an index; x == 1 (probability 0) is clipped.
    x = rng.power(spec.popularity_param, size=size)
    return np.minimum((x * n).astype(np.int64), n - 1)


def _draw_lengths(
    bounds: tuple[int, int], choices: tuple[int, ...], size: int, rng: np.random.Generator
) -> np.ndarray:
    if choices:
        return np.asarray(choices, dtype=np.int64)[rng.integers(0, len(choices), size=size)]
    lo, hi = bounds
    return rng.integers(lo, hi + 1, size=size)


def generate(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of ``spec``, sorted by arrival; deterministic for the spec (seed included)."""
    rng = np.random.default_rng(spec.seed)
    size = spec.num_requests
    shape = 1.0 / spec.cv**2
    gaps = rng.gamma(shape, spec.cv**2 / spec.rate, size=size)
    arrivals = np.cumsum(gaps)
    to_base = rng.random(size) < spec.base_fraction
    adapters = _draw_adapters(spec, rng) if spec.num_adapters > 0 else np.zeros(size, np.int64)
    prompt_lens = _draw_lengths(spec.input_len, spec.input_lens, size, rng)
    output_lens = _draw_lengths(spec.output_len, spec.output_lens, size, rng)
    shares = np.asarray([t.share for t in spec.tenants], dtype=np.float64)
    tenant_ids = rng.choice(len(spec.tenants), size=size, p=shares / shares.sum())
    return [
        WorkloadRequest(
            index=i,
            arrival_s=float(arrivals[i]),
            adapter=None if to_base[i] else int(adapters[i]),
            prompt_len=int(prompt_lens[i]),
            output_len=int(output_lens[i]),
            tenant=spec.tenants[tenant_ids[i]].name,
        )
        for i in range(size)
    ]


def prompt_token_ids(
    request: WorkloadRequest,
    *,
    vocab_size: int,
    seed: int,
    avoid: frozenset[int] = frozenset(),
) -> list[int]:
    """Exactly ``request.prompt_len`` token ids in ``[0, vocab_size)``, none of them in ``avoid``.

    Deterministic per ``(seed, request.index)``: ids are drawn uniformly from the allowed
    ids by ``numpy.random.default_rng([seed, request.index])``. Ids in ``avoid`` outside the
    vocabulary are ignored; a ValueError if no id is allowed.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    banned = np.asarray(sorted(t for t in avoid if 0 <= t < vocab_size), dtype=np.int64)
    allowed = vocab_size - len(banned)
    if allowed < 1:
        raise ValueError("every id in the vocabulary is in avoid")
    rng = np.random.default_rng([seed, request.index])
    compact = rng.integers(0, allowed, size=request.prompt_len)
    # compact value v is the v-th allowed id: v plus the number of banned ids at or below
    # it. banned[k] - k is the compact position of the k-th banned id (non-decreasing).
    shift = np.searchsorted(banned - np.arange(len(banned)), compact, side="right")
    return [int(t) for t in compact + shift]


def requests_with_prompts(
    spec: WorkloadSpec, *, vocab_size: int, avoid: frozenset[int] = frozenset()
) -> tuple[list[WorkloadRequest], dict[int, list[int]]]:
    """The requests of ``spec`` and each one's prompt token ids (request index -> ids)."""
    requests = generate(spec)
    prompts = {
        r.index: prompt_token_ids(r, vocab_size=vocab_size, seed=spec.seed, avoid=avoid)
        for r in requests
    }
    return requests, prompts
