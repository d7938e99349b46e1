import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from loramux.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    filter_logits,
    make_generator,
)
from loramux.engine.sampling_params import SamplingParams

V = 50
N_DRAWS = 20_000


def _logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * scale


def _row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    if params.seed is not None and generator is None:
        generator = make_generator(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator)


def _hf_filtered(logits_1d: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The same warpers, in the same order, from transformers."""
    scores = logits_1d[None].clone().float()
    ids = torch.zeros((1, 1), dtype=torch.long)
    procs = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k is not None:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        procs.append(MinPLogitsWarper(p.min_p))
    for proc in procs:
        scores = proc(ids, scores)
    return scores[0]


def _empirical(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).double() / len(tokens)


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_transformers():
    logits = _logits(3, seed=1)
    rows = [
        _row(SamplingParams(repetition_penalty=1.5), prompt=[1, 2, 2, 7], output=[7, 9, 9, 9]),
        _row(SamplingParams(repetition_penalty=0.6), prompt=[0, 49], output=[3]),
        _row(SamplingParams(repetition_penalty=1.0), prompt=[1, 2, 3], output=[4]),
    ]
    out = apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([[*row.prompt_token_ids, *row.output_token_ids]])
        proc = RepetitionPenaltyLogitsProcessor(penalty=row.params.repetition_penalty)
        expected = proc(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(out[i], expected, rtol=1e-6, atol=0)
    # The test must be able to fail: the penalised rows really changed (both signs seen).
    for i, ids in enumerate([[1, 2, 7, 9], [0, 49, 3]]):
        assert not torch.equal(out[i, ids], logits[i, ids])
    assert (logits[0, [1, 2, 7, 9]] > 0).any() and (logits[0, [1, 2, 7, 9]] < 0).any()
    assert torch.equal(out[2], logits[2])
    # Untouched tokens are bit-identical.
    untouched = [t for t in range(V) if t not in (1, 2, 7, 9)]
    assert torch.equal(out[0, untouched], logits[0, untouched])


def test_repetition_penalty_hand_computed_counts_each_id_once():
    logits = torch.tensor([[2.0, -2.0, 3.0, 0.5] + [0.0] * (V - 4)])
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=[0, 0, 0], output=[1, 1])
    out = apply_penalties(logits, [row])
    assert out[0, :4].tolist() == [1.0, -4.0, 3.0, 0.5]


def test_presence_frequency_hand_computed():
    logits = _logits(2, seed=2)
    prompt = [5, 6, 7, 7]  # prompt tokens must not count for presence/frequency
    output = [3, 3, 3, 8, 11, 8]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)
    rows = [_row(params, prompt, output), _row(SamplingParams(), prompt, output)]
    out = apply_penalties(logits, rows)

    expected = logits[0].clone()
    for t in range(V):
        c = output.count(t)
        expected[t] -= params.frequency_penalty * c + params.presence_penalty * (1 if c else 0)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-6)
    assert out[0, 3] == pytest.approx(logits[0, 3].item() - 0.7 + 1.2, abs=1e-6)
    assert torch.equal(out[0, prompt], logits[0, prompt])
    assert torch.equal(out[1], logits[1])


def test_all_penalties_compose_in_order():
    logits = torch.zeros(1, V)
    logits[0, :3] = torch.tensor([4.0, -4.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    row = _row(params, prompt=[0], output=[1, 1, 2])
    out = apply_penalties(logits, [row], [[2]])
    # token 0: 4 / 2; token 1: -4 * 2 - (0.5 * 2 + 1); token 2: suppressed
    assert out[0, 0].item() == 2.0
    assert out[0, 1].item() == -10.0
    assert out[0, 2].item() == -math.inf
    assert torch.equal(out[0, 3:], logits[0, 3:])


def test_penalties_compute_on_float32_copy():
    logits = _logits(1, seed=3).to(torch.bfloat16)
    before = logits.clone()
    out = apply_penalties(logits, [_row(SamplingParams(repetition_penalty=1.3), [1, 2], [3])])
    assert out.dtype == torch.float32
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_pick_lowest_index():
    logits = _logits(4, seed=4)
    logits[3] = 0.0
    logits[3, [7, 12, 30]] = 5.0
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(4)]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 4


def test_greedy_sees_penalties():
    logits = torch.zeros(1, V)
    logits[0, 10] = 3.0
    logits[0, 20] = 2.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [_row(params)]).token_ids == [10]
    assert Sampler().sample(logits, [_row(params, prompt=[10])]).token_ids == [20]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert Sampler().sample(logits, [_row(params, prompt=[10])]).token_ids == [10]
    assert Sampler().sample(logits, [_row(params, output=[10, 10])]).token_ids == [20]


def test_greedy_ignores_filters_and_seed():
    logits = _logits(1, seed=5)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=7)
    out = Sampler().sample(logits, [_row(params)])
    assert out.token_ids == [int(logits.argmax())]


# --------------------------------------------------------------------------- filters

FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.8),
    SamplingParams(top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(top_k=V + 10),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.05),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.3),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=repr)
def test_filter_logits_matches_transformers(params):
    logits = _logits(3, seed=6)
    out = filter_logits(logits, [params] * 3)
    for i in range(3):
        expected = _hf_filtered(logits[i], params)
        assert torch.equal(torch.isinf(out[i]), torch.isinf(expected))
        keep = torch.isfinite(expected)
        assert keep.any()
        torch.testing.assert_close(out[i][keep], expected[keep], rtol=1e-6, atol=0)


def test_filter_cases_are_not_trivial():
    """Each filter case above does remove tokens (or rescales), so the checks can fail."""
    logits = _logits(1, seed=6)[0]
    for p in FILTER_CASES:
        kept = int(torch.isfinite(_hf_filtered(logits, p)).sum())
        if p.top_k == 1 or p.top_p == 0.05:
            assert kept == 1
        elif p.top_k not in (None, V + 10) or p.top_p < 1 or p.min_p > 0:
            assert 1 < kept < V, p
        else:
            assert kept == V


def test_filters_hand_computed_small_example():
    # probs of softmax(log([.4, .3, .2, .1])) are exactly those values (up to rounding)
    base = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    logits = torch.full((1, V), -math.inf)
    logits[0, :4] = base

    def kept(**kw):
        out = filter_logits(logits, [SamplingParams(**kw)])
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.65) == [0, 1]  # .4 < .65, .4 + .3 >= .65
    assert kept(top_p=0.75) == [0, 1, 2]
    assert kept(top_p=0.01) == [0]
    assert kept(min_p=0.4) == [0, 1, 2]  # .1 < .4 * .4 <= .2
    assert kept(min_p=0.7) == [0, 1]  # .2 < .7 * .4 <= .3
    assert kept(top_k=3, min_p=0.6) == [0, 1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=4),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.15),
        SamplingParams(temperature=1.3, top_k=12, top_p=0.85, min_p=0.1),
    ],
    ids=repr,
)
def test_empirical_distribution_matches_filtered_softmax(params):
    logits_1 = _logits(1, seed=7, scale=1.5)
    logits = logits_1.expand(N_DRAWS, V)
    out = Sampler(seed=123).sample(logits, [_row(params) for _ in range(N_DRAWS)])

    expected = torch.softmax(_hf_filtered(logits_1[0], params).double(), dim=-1)
    allowed = set(torch.nonzero(expected > 0).flatten().tolist())
    assert set(out.token_ids) <= allowed
    freq = _empirical(out.token_ids)
    assert (freq - expected).abs().max().item() < 0.02
    # Would an unfiltered / untempered sampler pass this? It must not.
    if params != SamplingParams():
        plain = torch.softmax(logits_1[0].double(), dim=-1)
        assert (plain - expected).abs().max().item() > 0.04


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(N_DRAWS, V)
    logits[:, 3] = 10.0  # would win almost always
    logits[:, 4] = 9.0
    suppress = [[3, 4]] * N_DRAWS
    rows = [_row(SamplingParams()) for _ in range(N_DRAWS)]
    out = Sampler(seed=1).sample(logits, rows, suppress_token_ids=suppress)
    assert 3 not in out.token_ids and 4 not in out.token_ids
    assert len(set(out.token_ids)) > V // 2  # the rest stays uniform
    greedy = Sampler().sample(
        logits[:1], [_row(SamplingParams(temperature=0.0))], suppress_token_ids=[[3]]
    )
    assert greedy.token_ids == [4]
    # Without suppression the same setup picks 3 or 4 most of the time.
    plain = Sampler(seed=1).sample(logits[:200], rows[:200])
    assert sum(t in (3, 4) for t in plain.token_ids) > 190


# --------------------------------------------------------------------------- seeding


def _run_seeded(params, steps, others_before, others_after):
    """Sample `steps` tokens for one seeded row with other rows around it."""
    sampler = Sampler(seed=999)
    gen = make_generator(params.seed)
    output: list[int] = []
    other_gens = [make_generator(p.seed) if p.seed is not None else None for p in others_before]
    other_gens_after = [
        make_generator(p.seed) if p.seed is not None else None for p in others_after
    ]
    for step in range(steps):
        mine = _logits(1, seed=1000 + step)
        rows = [
            SamplingRow(p, [1, 2, 3], [4], g)
            for p, g in zip(others_before, other_gens, strict=True)
        ]
        pos = len(rows)
        rows.append(SamplingRow(params, [5, 6], list(output), gen))
        rows += [
            SamplingRow(p, [7], [], g) for p, g in zip(others_after, other_gens_after, strict=True)
        ]
        logits = _logits(len(rows), seed=5000 + step)
        logits[pos] = mine[0]
        output.append(sampler.sample(logits, rows).token_ids[pos])
    return output


OTHERS = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=5, top_p=0.5),
    SamplingParams(temperature=0.3, top_k=2, repetition_penalty=1.5, logprobs=3),
    SamplingParams(min_p=0.2, presence_penalty=1.0, frequency_penalty=0.5),
]


def test_seeded_row_is_batch_invariant():
    params = SamplingParams(
        temperature=1.2,
        top_k=30,
        top_p=0.95,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        seed=42,
    )
    steps = 12
    alone = _run_seeded(params, steps, [], [])
    assert _run_seeded(params, steps, OTHERS, []) == alone
    assert _run_seeded(params, steps, [], OTHERS) == alone
    assert _run_seeded(params, steps, OTHERS[::-1][:2], OTHERS[2:]) == alone
    assert _run_seeded(params, steps, OTHERS * 3, OTHERS[:1]) == alone
    assert len(set(alone)) > 3  # genuinely random, not collapsed to argmax


def test_same_seed_reproduces_and_different_seeds_differ():
    def run(seed):
        return _run_seeded(SamplingParams(seed=seed), 16, [], [])

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(2) != run(3)


def test_unseeded_rows_use_the_sampler_generator():
    logits = _logits(1, seed=8).expand(64, V)
    rows = [_row(SamplingParams()) for _ in range(64)]
    a = Sampler(seed=1).sample(logits, rows).token_ids
    assert Sampler(seed=1).sample(logits, rows).token_ids == a
    assert Sampler(seed=2).sample(logits, rows).token_ids != a
    sampler = Sampler(seed=1)
    sampler.sample(logits, rows)
    assert sampler.sample(logits, rows).token_ids != a  # the generator advanced


def test_seeded_row_consumes_same_randomness_whatever_its_params():
    logits = _logits(1, seed=9)
    states = []
    for params in [
        SamplingParams(seed=3),
        SamplingParams(seed=3, top_k=1),
        SamplingParams(seed=3, temperature=0.2, top_p=0.3, min_p=0.5, repetition_penalty=2.0),
    ]:
        gen = make_generator(3)
        Sampler().sample(logits, [SamplingRow(params, [1], [2], gen)])
        states.append(gen.get_state())
    assert torch.equal(states[0], states[1])
    assert torch.equal(states[0], states[2])
    assert not torch.equal(states[0], make_generator(3).get_state())


def test_seeded_row_without_generator_is_rejected():
    row = SamplingRow(SamplingParams(seed=1), [], [], None)
    with pytest.raises(ValueError, match="seed"):
        Sampler().sample(_logits(1), [row])


# --------------------------------------------------------------------------- mixed batch


def test_mixed_params_each_row_respects_its_own_filters():
    logits_1 = _logits(1, seed=10)
    cases = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=3.0),
    ]
    reps = 2000
    params = cases * reps
    logits = logits_1.expand(len(params), V)
    out = Sampler(seed=4).sample(logits, [_row(p) for p in params])
    for j, p in enumerate(cases):
        got = out.token_ids[j :: len(cases)]
        if p.greedy:
            assert set(got) == {int(logits_1.argmax())}
            continue
        expected = torch.softmax(_hf_filtered(logits_1[0], p).double(), dim=-1)
        assert set(got) <= set(torch.nonzero(expected > 0).flatten().tolist())
        assert (_empirical(got) - expected).abs().max().item() < 0.04


# --------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    logits = _logits(4, seed=11, scale=3.0).to(torch.float16)
    rows = [
        _row(SamplingParams(logprobs=0, temperature=0.3, repetition_penalty=1.8), [1, 2], [3]),
        _row(SamplingParams(logprobs=5, top_k=2, presence_penalty=2.0), [], [0, 1]),
        _row(SamplingParams(logprobs=None)),
        _row(SamplingParams(logprobs=20, temperature=0.0, frequency_penalty=-2.0), [], [9, 9]),
    ]
    suppress = [[], [int(logits[1].float().argmax())], [], []]
    out = Sampler(seed=2).sample(logits, rows, suppress_token_ids=suppress)
    raw = torch.log_softmax(logits.float(), dim=-1)

    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        n = rows[i].params.logprobs
        assert len(lp.top) == n
        ref = torch.sort(raw[i], descending=True)
        assert [t for t, _ in lp.top] == ref.indices[:n].tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref.values[:n].tolist(), abs=1e-6)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
    # Row 1's raw argmax was suppressed: its logprob is still reported from the raw logits.
    assert out.logprobs[1].top[0][0] == suppress[1][0]
    assert out.token_ids[1] != suppress[1][0]
    # The penalised / tempered distribution differs from the raw one, so using it would fail.
    penalised = torch.log_softmax(apply_penalties(logits, rows, suppress), dim=-1)
    assert not torch.allclose(penalised[3], raw[3], atol=1e-3)


# --------------------------------------------------------------------------- input checks


def test_empty_batch():
    out = Sampler().sample(torch.empty(0, V), [])
    assert out.token_ids == [] and out.logprobs == []


@pytest.mark.parametrize(
    ("logits", "n_rows", "suppress"),
    [
        (torch.zeros(2, V), 3, None),
        (torch.zeros(V), 1, None),
        (torch.zeros(2, V), 2, [[1]]),
        (torch.zeros(1, V, dtype=torch.long), 1, None),
        (torch.zeros(1, V), 1, [[V]]),
    ],
)
def test_bad_inputs_raise(logits, n_rows, suppress):
    rows = [_row(SamplingParams()) for _ in range(n_rows)]
    with pytest.raises(ValueError):
        Sampler().sample(logits, rows, suppress_token_ids=suppress)


def test_out_of_range_history_ids_raise():
    row = _row(SamplingParams(repetition_penalty=1.2), prompt=[V + 1])
    with pytest.raises(ValueError, match="token ids"):
        Sampler().sample(torch.zeros(1, V), [row])
