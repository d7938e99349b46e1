"""A higher-priority arrival cuts the running step short, and nothing changes but timing:
the abandoned step is recomputed, every request's tokens (greedy and seeded sampling, with
prefills part-way) equal those of an engine never interrupted, and the new request runs in
the very next step."""

from __future__ import annotations

import threading

from loramux.engine import SamplingParams
from loramux.engine.step_interrupt import PENDING_S, StepInterrupt, StepInterrupted
from tests.engine.factories import PROMPTS, build_engine
from tests.engine.hf_reference import greedy_tokens

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
]


def _run(engine, *, arrivals_at: list[int], interrupt: bool) -> dict[str, list[int]]:
    """Serve two priority-0 requests; before each step in ``arrivals_at`` a request of a
    higher priority than any so far arrives. With ``interrupt`` it is announced first (as
    from another thread) and cuts that step short, reaching the engine after it."""
    for i, params in enumerate(PARAMS):
        engine.add_request(f"low-{i}", PROMPTS[i], params, priority=0)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in arrivals_at:
            priority = 1 + arrivals_at.index(step)
            if interrupt:
                engine.note_arrival(priority)
                assert engine.step() == []  # abandoned before anything was sampled
            engine.add_request(f"high-{step}", PROMPTS[2], PARAMS[0], priority=priority)
            engine.step_interrupt.taken(priority)
            assert engine.scheduler.waiting_in_order()[0].request_id == f"high-{step}"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
        step += 1
    return tokens


def test_interrupted_steps_keep_every_request_exact(tiny_model_dir):
    # Chunks of 4 prompt tokens: the first interruptions fall inside the prefills. The
    # greedy requests must give transformers' tokens; the seeded one the tokens it gives
    # uninterrupted (a seeded draw does not depend on the batch).
    arrivals = [0, 2, 5, 9]
    reference = _run(
        build_engine(tiny_model_dir, max_prefill_chunk=4), arrivals_at=arrivals, interrupt=False
    )
    engine = build_engine(tiny_model_dir, max_prefill_chunk=4)
    interrupted = _run(engine, arrivals_at=arrivals, interrupt=True)
    assert engine.metrics.steps_interrupted._value.get() == len(arrivals)
    assert set(interrupted) == {"low-0", "low-1", *(f"high-{step}" for step in arrivals)}
    assert interrupted["low-1"] == reference["low-1"]
    for rid, prompt in [("low-0", PROMPTS[0]), *((f"high-{s}", PROMPTS[2]) for s in arrivals)]:
        ids = engine.tokenizer(prompt)["input_ids"]
        assert interrupted[rid] == greedy_tokens(tiny_model_dir, None, ids, 12), rid


def test_only_a_higher_priority_interrupts_and_an_announcement_lapses():
    interrupt = StepInterrupt()
    interrupt.begin(5)
    interrupt.arrived(5)  # the same priority waits for the step
    interrupt.check()
    interrupt.arrived(6)
    try:
        interrupt.check()
        raise AssertionError("a higher priority must interrupt")
    except StepInterrupted:
        pass
    interrupt.end()
    interrupt.taken(6)
    interrupt.taken(5)
    interrupt.begin(0)
    interrupt.check()  # both were taken: nothing is pending


def test_an_announced_request_that_never_arrives_stops_interrupting(monkeypatch):
    interrupt = StepInterrupt()
    now = [100.0]
    monkeypatch.setattr("loramux.engine.step_interrupt.time.monotonic", lambda: now[0])
    interrupt.arrived(9)
    interrupt.begin(0)
    try:
        interrupt.check()
        raise AssertionError("a pending higher priority interrupts the next step at once")
    except StepInterrupted:
        pass
    interrupt.end()
    now[0] += PENDING_S + 0.1
    interrupt.begin(0)
    interrupt.check()  # lapsed


def test_an_arrival_from_another_thread_interrupts_a_running_step(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    engine.add_request("low", PROMPTS[0], PARAMS[0], priority=0)
    checks = []
    check = engine.step_interrupt.check

    def check_and_announce():
        checks.append(1)
        if len(checks) == 2:  # the step is running: announce from another thread
            thread = threading.Thread(target=engine.note_arrival, args=(3,))
            thread.start()
            thread.join()
        check()

    engine.step_interrupt.check = check_and_announce
    assert engine.step() == []
    assert len(checks) == 2  # abandoned at the first boundary after the announcement
    engine.step_interrupt.check = check
    engine.step_interrupt.taken(3)
    assert len(engine.step()) == 1


def test_any_arrival_cuts_a_solo_step_short():
    interrupt = StepInterrupt()
    interrupt.begin(3, solo=True)
    interrupt.check()
    interrupt.arrived(0)  # a lower priority too: the solo step promised nobody waits
    try:
        interrupt.check()
        raise AssertionError("an arrival must cut a solo step short")
    except StepInterrupted:
        pass
    interrupt.end()
    interrupt.begin(3, solo=True)  # announced, not yet added: the next solo step stops at once
    try:
        interrupt.check()
        raise AssertionError("a pending arrival must cut a solo step short")
    except StepInterrupted:
        pass
    interrupt.end()
    interrupt.taken(0)
    interrupt.begin(3)  # not solo: the same arrival waits
    interrupt.arrived(0)
    interrupt.check()


def test_a_lone_prompt_s_solo_step_gives_way_to_any_arrival(tiny_model_dir):
    # A time budget of a microsecond keeps company-steps at the smallest chunk; alone, the
    # prompt's first step takes the whole token budget (solo). A same-priority arrival
    # announced during the next one cuts it short; the newcomer shares the step after, and
    # both requests still give transformers' tokens.
    engine = build_engine(tiny_model_dir, prefill_step_target_s=1e-6, max_num_batched_tokens=64)
    engine.scheduler.prompt_budget = lambda: 4  # the time budget's floor, whatever is measured
    long_prompt = " ".join(PROMPTS) * 3
    engine.add_request("long", long_prompt, PARAMS[0], priority=0)
    engine.step()
    long_seq = next(s for s in engine.scheduler.running if s.request_id == "long")
    assert long_seq.num_computed_tokens == 64  # solo: the token budget, not the 4 of the time
    engine.note_arrival(0)
    assert engine.step() == []  # cut short for the same priority: the step was solo
    assert engine.metrics.steps_interrupted._value.get() == 1
    engine.add_request("short", PROMPTS[1], PARAMS[0], priority=0)
    engine.step_interrupt.taken(0)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
    for rid, prompt in (("long", long_prompt), ("short", PROMPTS[1])):
        ids = engine.tokenizer(prompt)["input_ids"]
        assert tokens[rid] == greedy_tokens(tiny_model_dir, None, ids, 12), rid
