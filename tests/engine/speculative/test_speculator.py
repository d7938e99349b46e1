"""The speculator's pooled acceptance: a new request starts where its tenant's recent
requests on the same adapter left off, and never from another tenant's."""

from __future__ import annotations

from loramux.engine.sampling_params import SamplingParams
from loramux.engine.speculative.speculator import MIN_POOLED_EVIDENCE, Speculator


class _Seq:
    def __init__(self, speculation):
        self.speculation = speculation
        self.metrics = type("M", (), {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0})()


def _speculator() -> Speculator:
    return Speculator(max_k=4, ngram_max_n=4, ngram_min_n=2, max_model_len=512)


PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def test_new_requests_start_at_their_pools_recent_acceptance():
    speculator = _speculator()
    chat, copy = ("alice", None), ("alice", 7)
    assert speculator.start(PARAMS, chat).length.acceptance == 1.0  # no evidence: optimistic
    for pool, accepted in ((chat, 0), (copy, 4)):
        seq = _Seq(speculator.start(PARAMS, pool))
        for _ in range(int(MIN_POOLED_EVIDENCE) + 4):
            speculator.record(seq, 4, accepted)
    assert speculator.pooled_acceptance(chat) == 0.0
    assert speculator.pooled_acceptance(copy) == 1.0
    assert speculator.start(PARAMS, chat).length.next_k() == 0  # starts backed off
    assert speculator.start(PARAMS, copy).length.next_k() == 4


def test_another_tenants_requests_never_set_the_start():
    speculator = _speculator()
    seq = _Seq(speculator.start(PARAMS, ("mallory", None)))
    for _ in range(50):
        speculator.record(seq, 4, 0)  # proposals that always fail, on the base model
    assert speculator.pooled_acceptance(("mallory", None)) == 0.0
    assert speculator.start(PARAMS, ("alice", None)).length.acceptance == 1.0


def test_little_evidence_keeps_the_optimistic_start():
    speculator = _speculator()
    seq = _Seq(speculator.start(PARAMS, ("bob", 1)))
    speculator.record(seq, 4, 0)
    speculator.record(seq, 4, 0)
    assert speculator.pooled_acceptance(("bob", 1)) == 1.0
