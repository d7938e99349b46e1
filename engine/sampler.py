r"""Token sampling: logit bias, penalties, temperature, top-k / top-p / min-p and the draw.

Pure torch, no model. For one row (one sequence sampling a token this step) with raw
logits :math:`z \in \mathbb{R}^V` (computed in float32 on a copy), prompt tokens
:math:`P`, output tokens so far :math:`O` and :math:`c_v = |\{t \in O : t = v\}|`:

1. Logit bias (``params.logit_bias``, OpenAI): :math:`z_v \leftarrow z_v + b_v` for every
   biased :math:`v`.
2. Suppression (the engine passes EOS / stop ids while ``min_tokens`` is not reached):
   :math:`z_v \leftarrow -\infty` for every suppressed :math:`v`.
3. Repetition penalty :math:`r` (Hugging Face), for every :math:`v \in P \cup O`
   (each distinct id once): :math:`z_v \leftarrow z_v / r` if :math:`z_v > 0`, else
   :math:`z_v \leftarrow z_v \cdot r`.
4. Presence :math:`\alpha` and frequency :math:`\beta` penalties (OpenAI, output only):
   :math:`z_v \leftarrow z_v - \beta c_v - \alpha [c_v > 0]`.

   Grammar mask (rows with a structured output, ``masks``): :math:`z_v \leftarrow -\infty`
   for every token :math:`v` the row's grammar does not allow next. After the bias and
   penalties, before what follows, so the greedy argmax, temperature and the filters see
   only allowed tokens.
5. Greedy (:math:`T = 0`): :math:`y = \arg\max_v z_v` (lowest index on ties, as
   ``torch.argmax``); nothing below applies and no randomness is consumed.

   Otherwise :math:`x = z / T`, then, each optional and in this order:

   * top-k: keep :math:`v` with :math:`x_v \ge x_{(k)}`, the k-th largest value (tokens
     tied with it are kept as well);
   * top-p: with :math:`p = \mathrm{softmax}(x)` sorted descending (stable, so ties go
     by token id) as :math:`p_{(1)} \ge p_{(2)} \ge \dots`, keep :math:`(j)` iff
     :math:`\sum_{i<j} p_{(i)} < \text{top\_p}`: the smallest prefix whose mass reaches
     top_p (the most likely token is always kept);
   * min-p: with :math:`p = \mathrm{softmax}(x)`, keep :math:`v` iff
     :math:`p_v \ge \text{min\_p} \cdot \max_u p_u`;

   dropped tokens get :math:`x_v = -\infty` and :math:`\pi = \mathrm{softmax}(x)`.
6. Draw (exponential race): :math:`q_v \sim \mathrm{Exp}(1)` i.i.d., :math:`V` of them
   from the row's generator, and :math:`y = \arg\max_v \pi_v / q_v`, which has
   :math:`\Pr[y = v] = \pi_v`. A row with its own generator (a seeded request) consumes
   exactly :math:`V` exponentials per step whatever its parameters, and its
   :math:`\pi` depends only on its own logits and parameters, so its tokens are the same
   whichever other rows share the batch and in whatever order. Rows without one share
   the sampler's generator (one bulk draw per step), so they are reproducible only for
   the same batch.
7. Log-probabilities (when ``params.logprobs`` is not None) come from
   :math:`\log\mathrm{softmax}(z^{\text{raw}})`, the logits as given, before any of
   the steps above: the sampled token's value plus the top-N (descending).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loramux.engine.sampling_params import SamplingParams
from loramux.engine.structured import StepMasks

if TYPE_CHECKING:
    from loramux.engine.speculative.verify import VerifiedTokens, VerifyGroup

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "TokenLogprobs",
    "apply_penalties",
    "exponential_race",
    "filter_logits",
    "logprobs_of",
    "make_generator",
]

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One sequence that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's own generator when params.seed is set; None uses the sampler's.
    generator: torch.Generator | None = None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N (token_id, logprob), descending; empty for N = 0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for a seeded request (create it once per request, not per step)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _ids_tensor(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long, device="cpu")
    return t.reshape(-1)


def _check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{what} must be in [0, {vocab}) (the logits' vocab), got "
            f"min {int(ids.min())}, max {int(ids.max())}"
        )


def _param_column(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """One float parameter of every row as a float32 [rows, 1] column on ``device``."""
    values = [getattr(row.params, name) for row in rows]
    return torch.tensor(values, dtype=torch.float32).to(device)[:, None]


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    suppress_token_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Steps 1-4 of the module docstring; returns a new float32 tensor ([rows, vocab])."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
        )
    if suppress_token_ids is not None and len(suppress_token_ids) != len(rows):
        raise ValueError(
            f"suppress_token_ids must have one entry per row ({len(rows)}), "
            f"got {len(suppress_token_ids)}"
        )
    out = logits.to(dtype=torch.float32, copy=True)
    n, vocab = out.shape
    device = out.device

    def scatter_index(pairs: list[tuple[int, torch.Tensor]], what: str):
        row_idx = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids in pairs])
        tok_idx = torch.cat([ids for _, ids in pairs])
        _check_ids(tok_idx, vocab, what)
        return row_idx.to(device), tok_idx.to(device)

    # 1. logit bias: a scatter-add over the biased rows' few (row, token) pairs only
    pairs = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if pairs:
        r, t = scatter_index([(i, _ids_tensor(list(bias))) for i, bias in pairs], "logit_bias")
        values = [v for _, bias in pairs for v in bias.values()]
        out.index_put_(
            (r, t), torch.tensor(values, dtype=torch.float32).to(device), accumulate=True
        )

    # 2. suppression
    if suppress_token_ids is not None:
        pairs = [(i, _ids_tensor(ids)) for i, ids in enumerate(suppress_token_ids)]
        pairs = [(i, ids) for i, ids in pairs if ids.numel()]
        if pairs:
            r, t = scatter_index(pairs, "suppress_token_ids")
            out[r, t] = _NEG_INF

    # 3. repetition penalty over prompt + output (distinct ids: a boolean mask)
    rep = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    pairs = []
    for i in rep:
        ids = torch.cat(
            [_ids_tensor(rows[i].prompt_token_ids), _ids_tensor(rows[i].output_token_ids)]
        )
        if ids.numel():
            pairs.append((i, ids))
    if pairs:
        r, t = scatter_index(pairs, "prompt/output token ids")
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)
        seen[r, t] = True
        pen = _param_column(rows, "repetition_penalty", device)
        penalised = torch.where(out > 0, out / pen, out * pen)
        out = torch.where(seen, penalised, out)

    # 4. presence / frequency over output tokens (counts via an accumulating scatter)
    pf = [
        i
        for i, row in enumerate(rows)
        if (row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0)
        and len(row.output_token_ids)
    ]
    if pf:
        pairs = [(i, _ids_tensor(rows[i].output_token_ids)) for i in pf]
        r, t = scatter_index(pairs, "output token ids")
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=device)
        counts.index_put_((r, t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
        freq = _param_column(rows, "frequency_penalty", device)
        pres = _param_column(rows, "presence_penalty", device)
        out = out - (freq * counts + pres * (counts > 0).to(torch.float32))
    return out


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Step 5 for non-greedy rows: temperature, then top-k, top-p, min-p.

    ``logits`` is [len(params), vocab] (already penalised); returns a new float32 tensor
    with dropped tokens at -inf. ``softmax`` of it is the distribution that is sampled.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits must be [len(params)={len(params)}, vocab], got {tuple(logits.shape)}"
        )
    if any(p.greedy for p in params):
        raise ValueError("filter_logits is for non-greedy rows (temperature > 0)")
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device)
    x = logits.to(torch.float32) / temps[:, None]

    def subset(sel: list[int]) -> torch.Tensor:
        return torch.tensor(sel, dtype=torch.long).to(device)

    # top-k: threshold at the k-th largest value
    sel = [i for i, p in enumerate(params) if p.top_k is not None and p.top_k < vocab]
    if sel:
        idx = subset(sel)
        ks = [params[i].top_k for i in sel]
        sub = x[idx]
        top_vals = sub.topk(max(ks), dim=-1).values  # sorted, descending
        kth = top_vals.gather(1, (torch.tensor(ks, dtype=torch.long).to(device) - 1)[:, None])
        x[idx] = sub.masked_fill(sub < kth, _NEG_INF)

    # top-p: keep the sorted prefix whose exclusive cumulative mass is still < top_p
    sel = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if sel:
        idx = subset(sel)
        ps = torch.tensor([params[i].top_p for i in sel], dtype=torch.float32).to(device)
        sub = x[idx]
        sorted_p, order = sub.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
        cum = sorted_p.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        drop_sorted = before >= ps[:, None]
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        x[idx] = sub.masked_fill(drop, _NEG_INF)

    # min-p: drop tokens less likely than min_p times the most likely one
    sel = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if sel:
        idx = subset(sel)
        mps = torch.tensor([params[i].min_p for i in sel], dtype=torch.float32).to(device)
        sub = x[idx]
        probs = sub.softmax(dim=-1)
        drop = probs < mps[:, None] * probs.amax(dim=-1, keepdim=True)
        x[idx] = sub.masked_fill(drop, _NEG_INF)
    return x


def exponential_race(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
) -> torch.Tensor:
    r"""Step 6: one token per row of ``probs`` [n, vocab] (non-negative weights; a row's scale
    does not matter, so it need not be normalised), drawn as :math:`\arg\max_v \pi_v / E_v`
    with :math:`E_v \sim \mathrm{Exp}(1)`. ``generators[j]`` is row j's own generator, or
    None for ``shared_generator`` (on ``probs``' device): first one bulk draw of the shared
    rows' exponentials, then ``vocab`` of them from each own generator, in row order.
    Returns [n] long token ids on ``probs``' device."""
    n, vocab = probs.shape
    device = probs.device
    q = torch.empty((n, vocab), dtype=torch.float32, device=device)
    shared = [j for j, gen in enumerate(generators) if gen is None]
    if shared:
        draw = torch.empty((len(shared), vocab), dtype=torch.float32, device=device)
        draw.exponential_(generator=shared_generator)
        q[torch.tensor(shared, dtype=torch.long).to(device)] = draw
    for j, gen in enumerate(generators):
        if gen is not None:
            draw = torch.empty(vocab, dtype=torch.float32, device=gen.device)
            q[j] = draw.exponential_(generator=gen).to(device)
    # Exp(1) can round to 0: clamp so a dropped token (prob 0) never gives 0/0.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / q).argmax(dim=-1)


class Sampler:
    """Samples one token per row. See the module docstring for the exact semantics."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {
            torch.device("cpu"): make_generator(seed, "cpu")
        }

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = make_generator(self._seed, device)
            self._generators[device] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        *,
        suppress_token_ids: list[Sequence[int]] | None = None,
        masks: StepMasks | None = None,
    ) -> SamplerOutput:
        """One token per row. ``masks``: the grammar masks of the rows that have one
        (``StepMasks.rows`` index ``rows``), None when no row has a grammar."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        for i, row in enumerate(rows):
            if row.params.seed is not None and row.generator is None:
                raise ValueError(
                    f"row {i} has params.seed={row.params.seed} but no generator; "
                    "create one per request with make_generator(seed, device)"
                )
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        device = logits.device
        n = logits.shape[0]

        z = apply_penalties(logits, rows, suppress_token_ids)
        if masks is not None:
            masks.apply(z)
        tokens = torch.empty(n, dtype=torch.long, device=device)

        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, dtype=torch.long).to(device)
            tokens[idx] = z[idx].argmax(dim=-1)

        rand = [i for i, row in enumerate(rows) if not row.params.greedy]
        if rand:
            idx = torch.tensor(rand, dtype=torch.long).to(device)
            probs = filter_logits(z[idx], [rows[i].params for i in rand]).softmax(dim=-1)
            generators = [rows[i].generator for i in rand]
            tokens[idx] = exponential_race(probs, generators, self._generator(device))

        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, dtype=torch.long).to(device)
            found = logprobs_of(logits[idx], tokens[idx], [rows[i].params.logprobs for i in want])
            for i, item in zip(want, found, strict=True):
                logprobs[i] = item
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def verify(self, logits: torch.Tensor, groups: list[VerifyGroup]) -> list[VerifiedTokens]:
        """Speculative verification (:mod:`loramux.engine.speculative.verify`): the accepted
        proposals and one more token per group, unseeded groups drawing from this sampler's
        generator for ``logits``' device."""
        from loramux.engine.speculative.verify import verify  # it imports this module

        return verify(logits, groups, self._generator(logits.device))


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, top_counts: Sequence[int]
) -> list[TokenLogprobs]:
    """Each row's ``log_softmax(logits)`` at its token, and its ``top_counts[i]`` most likely
    tokens (descending). ``logits`` [n, vocab] (raw: nothing applied), ``token_ids`` [n]."""
    vocab = logits.shape[1]
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [n, vocab]
    chosen = raw.gather(1, token_ids[:, None].to(raw.device))[:, 0].tolist()
    ids = token_ids.tolist()
    n_top = min(max(top_counts, default=0), vocab)
    top_vals: list[list[float]] = [[] for _ in ids]
    top_ids: list[list[int]] = [[] for _ in ids]
    if n_top:
        top = raw.topk(n_top, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for j, k in enumerate(top_counts):
        pairs = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out.append(TokenLogprobs(token_id=ids[j], logprob=chosen[j], top=pairs))
    return out
