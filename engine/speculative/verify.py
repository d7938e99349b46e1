r"""Exact verification of speculative proposals: which drafts to keep, and one more token.

A speculating sequence proposed :math:`k \ge 0` draft tokens :math:`d_0 \dots d_{k-1}`,
drawn from distributions :math:`q_0 \dots q_{k-1}` (``draft_probs``; for a deterministic
proposer such as n-gram lookup :math:`q_i = \delta_{d_i}`, a point mass). The target ran
:math:`k + 1` query rows in one forward: row :math:`i`'s raw logits :math:`z_i` are its
next-token logits after the sequence's tokens and :math:`d_0 \dots d_{i-1}`. Every row goes
through the sampler's steps 1-4 (:func:`~loramux.engine.sampler.apply_penalties`, its
output tokens counting :math:`d_0 \dots d_{i-1}`, its own suppressed ids), all rows of the
step at once; for a sampling request :math:`\pi_i = \mathrm{softmax}(\mathrm{filter}(z_i))`
(:func:`~loramux.engine.sampler.filter_logits`), exactly what ``Sampler.sample`` would draw
row :math:`i`'s token from. The group emits the accepted prefix :math:`d_0 \dots d_{a-1}`
and one more token :math:`y` (so :math:`1 \dots k + 1` tokens), :math:`y` coming from row
:math:`a`:

* Greedy (``params.greedy``): :math:`a = \min\{i < k : \arg\max z_i \ne d_i\}`
  (:math:`k` when there is none) and :math:`y = \arg\max z_a`: the tokens greedy decoding
  emits one step at a time. No randomness is consumed.
* Sampling (the rejection rule of Leviathan et al. 2023 / Chen et al. 2023): with
  :math:`u_i \sim U[0, 1)` i.i.d., draft :math:`i` is accepted iff

  .. math:: q_i(d_i) > 0,\quad \pi_i(d_i) > 0 \quad\text{and}\quad
            u_i\, q_i(d_i) \le \pi_i(d_i),

  i.e. with probability :math:`\min(1, \pi_i(d_i) / q_i(d_i))` (a point mass: :math:`\pi_i(d_i)`).
  :math:`a` is the first rejected draft (:math:`k` if none), and :math:`y \sim r` with

  .. math:: r = \pi_k \text{ if } a = k, \qquad
            r \propto \max(\pi_a - q_a, 0) \text{ otherwise}

  (a point mass removes :math:`d_a` from :math:`\pi_a`); where that residual sums to 0
  (:math:`\pi_a = q_a` up to rounding, when a rejection has probability 0), :math:`r = \pi_a`.
  :math:`y` is drawn by the sampler's exponential race
  (:func:`~loramux.engine.sampler.exponential_race`), which needs :math:`r` unnormalised only.

Why the output is the target's: given the prefix, draft :math:`i` is :math:`x` and accepted
with probability :math:`q_i(x) \min(1, \pi_i(x)/q_i(x)) = \min(q_i(x), \pi_i(x))`, so a
rejection has probability :math:`\beta = 1 - \sum_x \min(q_i(x), \pi_i(x)) = \sum_x
\max(\pi_i(x) - q_i(x), 0)`, and the token emitted at position :math:`i` is :math:`x` with
probability :math:`\min(q_i(x), \pi_i(x)) + \beta \cdot \max(\pi_i(x) - q_i(x), 0) / \beta =
\pi_i(x)`. Each row's :math:`\pi_i` is the target's conditional given the emitted prefix, so
by induction over the positions the emitted tokens are distributed as sampling them from the
target one step at a time (the tokens after a correction come from later steps, whose rows
condition on it). A draft the target's filters removed (:math:`\pi_i(d_i) = 0`) is always
rejected; every emitted token lies in its row's filtered support (:math:`r \le \pi_a`).

Randomness, per group: greedy none; a seeded request (``row.generator``) draws :math:`k`
uniforms (``torch.rand``) and then the race's :math:`V` exponentials from its own generator,
whatever is accepted and whichever other groups share the step, so its tokens depend only on
its seed and its own logits (they are not those of the same seed without speculation: how
the randomness is used differs; only the distribution is the same). Unseeded groups share
``shared_generator``: one bulk draw of all their drafts' uniforms, then the race's bulk draw.
A batch of groups with :math:`k = 0` is exactly ``Sampler.sample`` (same tokens, same draws).

Log-probabilities (``params.logprobs`` not None) of each emitted token come from the raw
logits of the row that emitted it (:func:`~loramux.engine.sampler.logprobs_of`), as
``Sampler.sample`` does. Structured outputs (grammar masks) never speculate: rejected here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loramux.engine.sampler import (
    SamplingRow,
    TokenLogprobs,
    apply_penalties,
    exponential_race,
    filter_logits,
    logprobs_of,
)

__all__ = ["VerifiedTokens", "VerifyGroup", "accept_drafts", "residual", "verify"]

# How far a draft distribution's row sum may be from 1 (float rounding, low-precision drafts).
_Q_SUM_TOLERANCE = 1e-2


@dataclass
class VerifyGroup:
    """One speculating sequence's rows of the step."""

    # k + 1 rows sharing one request's params and generator; row i's output_token_ids
    # already end with d_0 .. d_{i-1}.
    rows: list[SamplingRow]
    # k + 1 entries: the ids suppressed at each row (EOS / stop ids while under min_tokens).
    suppress_token_ids: list[list[int]]
    # The k drafts (k may be 0: then the group samples one ordinary token).
    draft_token_ids: list[int]
    # [k, vocab]: the distribution each draft was drawn from; None for a deterministic
    # proposer (n-gram), whose q_i is a point mass at d_i.
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifiedTokens:
    # The accepted drafts then one more token: 1 .. k + 1 tokens.
    token_ids: list[int]
    # One per emitted token (all None when params.logprobs is None), from the raw logits of
    # the row that emitted it.
    logprobs: list[TokenLogprobs | None]
    # Drafts accepted: len(token_ids) - 1.
    num_accepted: int


def accept_drafts(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    r"""The acceptance test: ``u``, :math:`\pi_i(d_i)`, :math:`q_i(d_i)` are [drafts]; returns
    [drafts] bool, :math:`[q > 0]\,[\pi > 0]\,[u\,q \le \pi]`."""
    return (q_draft > 0) & (p_draft > 0) & (u * q_draft <= p_draft)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r"""The distribution (unnormalised) a rejection draws from: :math:`\max(p - q, 0)` per row
    of [n, vocab], or :math:`p` where that is all 0. A row with :math:`q = 0` gives :math:`p`
    itself (bit for bit): that is how a group that accepted every draft draws its bonus."""
    r = (p - q).clamp_(min=0.0)
    empty = r.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(empty, p, r)


def _check(logits: torch.Tensor, groups: Sequence[VerifyGroup]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    vocab = logits.shape[1]
    total = sum(len(g.rows) for g in groups)
    if logits.shape[0] != total:
        raise ValueError(
            f"logits must have one row per group row ({total} in {len(groups)} groups), "
            f"got {logits.shape[0]}"
        )
    for n, g in enumerate(groups):
        k = len(g.draft_token_ids)
        if len(g.rows) != k + 1:
            raise ValueError(f"group {n}: {k} drafts need {k + 1} rows, got {len(g.rows)}")
        if len(g.suppress_token_ids) != k + 1:
            raise ValueError(
                f"group {n}: suppress_token_ids needs {k + 1} entries (one per row), "
                f"got {len(g.suppress_token_ids)}"
            )
        bad = [d for d in g.draft_token_ids if not 0 <= d < vocab]
        if bad:
            raise ValueError(f"group {n}: draft token ids must be in [0, {vocab}), got {bad}")
        first = g.rows[0]
        for i, row in enumerate(g.rows):
            if row.params is not first.params and row.params != first.params:
                raise ValueError(f"group {n}: row {i}'s params differ from row 0's (one request)")
            if row.generator is not first.generator:
                raise ValueError(f"group {n}: row {i}'s generator is not row 0's (one request)")
            if i and list(row.output_token_ids[-i:]) != list(g.draft_token_ids[:i]):
                raise ValueError(f"group {n}: row {i}'s output tokens must end with drafts [:{i}]")
        if first.params.seed is not None and first.generator is None:
            raise ValueError(
                f"group {n} has params.seed={first.params.seed} but no generator; "
                "create one per request with make_generator(seed, device)"
            )
        if first.params.structured is not None:
            raise ValueError(f"group {n}: a request with a structured output cannot speculate")
        if g.draft_probs is not None and tuple(g.draft_probs.shape) != (k, vocab):
            raise ValueError(
                f"group {n}: draft_probs must be [k={k}, vocab={vocab}], "
                f"got {tuple(g.draft_probs.shape)}"
            )


def _draft_probs(groups: Sequence[VerifyGroup], device: torch.device) -> torch.Tensor | None:
    """The groups' q rows concatenated ([sum k of groups with draft_probs, vocab] float32),
    checked to be distributions; None when no group has any."""
    parts = [g.draft_probs for g in groups if g.draft_probs is not None and len(g.draft_probs)]
    if not parts:
        return None
    q = torch.cat([part.to(device=device, dtype=torch.float32) for part in parts])
    ok, worst = torch.stack(
        [(torch.isfinite(q) & (q >= 0)).all().float(), (q.sum(dim=-1) - 1).abs().max()]
    ).tolist()
    if not ok:
        raise ValueError("draft_probs must be finite and non-negative")
    if worst > _Q_SUM_TOLERANCE:
        raise ValueError(f"draft_probs rows must sum to 1, one is off by {worst:.3g}")
    return q


def _uniforms(
    groups: Sequence[VerifyGroup], shared_generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One U[0, 1) per draft of ``groups``, flattened in order ([drafts] float32): the
    unseeded groups' in one bulk draw from ``shared_generator``, then k from each seeded
    group's own generator."""
    shared: list[int] = []  # positions of the unseeded groups' drafts
    own: list[tuple[int, int, torch.Generator]] = []  # (first, end, generator) of the rest
    first = 0
    for g in groups:
        end = first + len(g.draft_token_ids)
        gen = g.rows[0].generator
        if gen is None:
            shared.extend(range(first, end))
        elif end > first:
            own.append((first, end, gen))
        first = end
    u = torch.empty(first, dtype=torch.float32, device=device)
    if shared:
        draw = torch.rand(len(shared), generator=shared_generator, device=device)
        u[torch.tensor(shared, dtype=torch.long).to(device)] = draw
    for a, b, gen in own:
        u[a:b] = torch.rand(b - a, generator=gen, device=gen.device).to(device)
    return u


def _starts(groups: Sequence[VerifyGroup]) -> list[int]:
    """Each group's first row in the concatenation of the groups' rows."""
    starts, start = [], 0
    for g in groups:
        starts.append(start)
        start += len(g.rows)
    return starts


def _first_rejection(accepted: Sequence[bool]) -> int:
    return next((i for i, ok in enumerate(accepted) if not ok), len(accepted))


def _verify_greedy(
    z: torch.Tensor, groups: list[VerifyGroup], starts: list[int]
) -> tuple[list[int], list[int]]:
    """Each greedy group's number of accepted drafts and its one more token; ``z``
    [rows, vocab] holds the groups' penalised rows in order, group g's from ``starts[g]``."""
    choice = z.argmax(dim=-1).tolist()
    counts, tokens = [], []
    for g, s in zip(groups, starts, strict=True):
        drafts = g.draft_token_ids
        a = _first_rejection([choice[s + i] == d for i, d in enumerate(drafts)])
        counts.append(a)
        tokens.append(choice[s + a])
    return counts, tokens


def _verify_sampled(
    z: torch.Tensor,
    groups: list[VerifyGroup],
    starts: list[int],
    shared_generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """Each sampling group's number of accepted drafts and its one more token, by the
    rejection rule of the module docstring; ``z`` as for :func:`_verify_greedy`."""
    device, vocab = z.device, z.shape[1]
    long = {"dtype": torch.long, "device": device}
    params = [g.rows[0].params for g in groups for _ in g.rows]
    probs = filter_logits(z, params).softmax(dim=-1)  # [rows, vocab]: every row's pi

    # Every draft, flattened in group order: its row in probs, its id and its row in q (None:
    # a point mass).
    draft_rows: list[int] = []
    draft_ids: list[int] = []
    q_rows: list[int | None] = []
    num_dense = 0
    for g, s in zip(groups, starts, strict=True):
        k = len(g.draft_token_ids)
        draft_rows.extend(range(s, s + k))
        draft_ids.extend(g.draft_token_ids)
        if g.draft_probs is None:
            q_rows.extend([None] * k)
        else:
            q_rows.extend(range(num_dense, num_dense + k))
            num_dense += k
    q = _draft_probs(groups, device)  # [dense drafts, vocab]

    accepted: list[bool] = []
    if draft_ids:
        ids = torch.tensor(draft_ids, **long)
        p_draft = probs[torch.tensor(draft_rows, **long), ids]  # [drafts]
        q_draft = torch.ones_like(p_draft)  # point masses: q_i(d_i) = 1
        dense = [j for j, r in enumerate(q_rows) if r is not None]
        if dense:
            dst = torch.tensor(dense, **long)
            q_draft[dst] = q[torch.tensor([q_rows[j] for j in dense], **long), ids[dst]]
        u = _uniforms(groups, shared_generator, device)
        accepted = accept_drafts(u, p_draft, q_draft).tolist()

    # Each group's row of its last token and the q it subtracts there (0 after accepting
    # every draft: the bonus token draws from pi_k itself).
    counts, final_rows = [], []
    dense_dst, dense_src, point_dst, point_ids = [], [], [], []
    first = 0  # the group's first draft in the flattened lists
    for n, (g, s) in enumerate(zip(groups, starts, strict=True)):
        k = len(g.draft_token_ids)
        a = _first_rejection(accepted[first : first + k])
        counts.append(a)
        final_rows.append(s + a)
        if a < k and q_rows[first + a] is None:
            point_dst.append(n)
            point_ids.append(g.draft_token_ids[a])
        elif a < k:
            dense_dst.append(n)
            dense_src.append(q_rows[first + a])
        first += k
    q_final = torch.zeros((len(groups), vocab), dtype=torch.float32, device=device)
    if dense_dst:
        q_final[torch.tensor(dense_dst, **long)] = q[torch.tensor(dense_src, **long)]
    if point_dst:
        q_final[torch.tensor(point_dst, **long), torch.tensor(point_ids, **long)] = 1.0
    dist = residual(probs[torch.tensor(final_rows, **long)], q_final)  # [groups, vocab]
    generators = [g.rows[0].generator for g in groups]
    return counts, exponential_race(dist, generators, shared_generator).tolist()


def verify(
    logits: torch.Tensor, groups: list[VerifyGroup], shared_generator: torch.Generator
) -> list[VerifiedTokens]:
    """The accepted drafts and one more token of every group (module docstring).

    ``logits`` [sum of (k + 1) over groups, vocab]: the target's raw logits, the groups' rows
    concatenated in order. ``shared_generator`` (on ``logits``' device) draws for the groups
    without a generator of their own.
    """
    _check(logits, groups)
    if not groups:
        return []
    device = logits.device
    long = {"dtype": torch.long, "device": device}
    rows = [row for g in groups for row in g.rows]
    suppress = [ids for g in groups for ids in g.suppress_token_ids]
    # None when nothing is suppressed: the same logits, without a scatter per row.
    z = apply_penalties(logits, rows, suppress if any(suppress) else None)  # [rows, vocab]
    starts = _starts(groups)

    counts = [0] * len(groups)
    last = [0] * len(groups)
    for is_greedy in (True, False):
        which = [n for n, g in enumerate(groups) if g.rows[0].params.greedy == is_greedy]
        if not which:
            continue
        sub, sub_z, local = groups, z, starts  # every group is of this kind: no gather
        if len(which) < len(groups):
            sub = [groups[n] for n in which]
            index = [starts[n] + i for n in which for i in range(len(groups[n].rows))]
            sub_z, local = z[torch.tensor(index, **long)], _starts(sub)
        if is_greedy:
            found = _verify_greedy(sub_z, sub, local)
        else:
            found = _verify_sampled(sub_z, sub, local, shared_generator)
        for n, a, token in zip(which, *found, strict=True):
            counts[n], last[n] = a, token

    emitted = [
        [*g.draft_token_ids[:a], token] for g, a, token in zip(groups, counts, last, strict=True)
    ]
    logprobs: list[list[TokenLogprobs | None]] = [[None] * len(e) for e in emitted]
    want = [n for n, g in enumerate(groups) if g.rows[0].params.logprobs is not None]
    if want:
        # Emitted token j of a group came from its row j.
        index = [starts[n] + j for n in want for j in range(len(emitted[n]))]
        tokens = [t for n in want for t in emitted[n]]
        tops = [groups[n].rows[0].params.logprobs for n in want for _ in emitted[n]]
        found = iter(
            logprobs_of(logits[torch.tensor(index, **long)], torch.tensor(tokens, **long), tops)
        )
        for n in want:
            logprobs[n] = [next(found) for _ in emitted[n]]
    return [
        VerifiedTokens(token_ids=e, logprobs=lp, num_accepted=a)
        for e, lp, a in zip(emitted, logprobs, counts, strict=True)
    ]
