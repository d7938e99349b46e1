"""One engine over two CPU processes (gloo) gives the greedy tokens of one process and of
transformers + PEFT: a mixed-adapter batch (ranks 4, 8 and 16 over different targets)
arriving at different steps, with prefix-cache hits and preemptions forced by a small
budget, on the tiny model (2 KV heads: one per rank) and on one whose 3 KV heads are
replicated over the 2 ranks (with biases on every projection: the row-parallel ones are
added once). Each engine's other rank is a real process, stopped by ``close``; a killed
rank fails the engine's next step with an error naming it, and so does a stopped one, by
its heartbeat's silence.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine import Engine, SamplingParams
from loramux.engine.memory.arena import DeviceArena, RowLayout
from loramux.engine.model.config import ModelConfig
from loramux.engine.parallel.commands import RunStep
from loramux.engine.parallel.ranks import RankFailed
from loramux.engine.parallel.shard import ShardPlan
from loramux.kernels import dispatch
from tests.engine.factories import build_engine, put_adapters_on_device
from tests.engine.hf_reference import greedy_tokens
from tests.engine.speculative.test_speculative_engine import NGRAM as SPECULATIVE
from tests.engine.speculative.test_speculative_engine import assert_speculated
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    FORMAT_ADAPTER_SPECS,
    MOE_ADAPTER_SPECS,
    assert_matches_reference,
    device_rows,
    mixed_requests,
    run_staggered,
)
from tests.engine.test_static_decode import run_ragged
from tests.fixtures.models import build_tiny_model
from tests.fixtures.processes import child_pids

SYSTEM = "You are a helpful assistant who answers briefly and precisely. "
MAX_TOKENS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96


def _with_random_biases(model_dir):
    """Give every bias of the checkpoint random values (they are zeros from init)."""
    path = model_dir / "model.safetensors"
    state = load_file(path)
    generator = torch.Generator().manual_seed(7)
    for name, tensor in state.items():
        if name.endswith(".bias"):
            state[name] = 0.1 * torch.randn(tensor.shape, generator=generator)
    save_file(state, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def replicated_kv_model_dir(tmp_path_factory, tokenizer_dir):
    """6 query heads sharing 3 KV heads (each KV head repeated twice over 2 ranks)."""
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("tiny-3kv"),
        tokenizer_dir,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        attention_bias=True,
        mlp_bias=True,
    )
    return _with_random_biases(model_dir)


@pytest.fixture(scope="module")
def gemma3_model_dir(tmp_path_factory, tokenizer_dir):
    """Another family over two ranks: q/k norms and Gemma's norms are every rank's, the
    scaled embedding is vocabulary-parallel and tied to the head."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3-tp"), tokenizer_dir, family="gemma3", norm_noise=0.2
    )


@pytest.fixture(scope="module")
def qwen3_moe_model_dir(tmp_path_factory, tokenizer_dir):
    """A mixture-of-experts family over two ranks: each rank holds every expert's half of
    its intermediate size and the whole router; a dense layer between routed ones."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe-tp"), tokenizer_dir, family="qwen3_moe"
    )


@pytest.fixture(params=["split-kv", "replicated-kv", "gemma3", "qwen3_moe"])
def model_and_adapters(request, tiny_model_dir, make_adapter):
    model_dir = {
        "split-kv": lambda: tiny_model_dir,
        "replicated-kv": lambda: request.getfixturevalue("replicated_kv_model_dir"),
        "gemma3": lambda: request.getfixturevalue("gemma3_model_dir"),
        "qwen3_moe": lambda: request.getfixturevalue("qwen3_moe_model_dir"),
    }[request.param]()
    # DoRA's row-parallel norms are summed over ranks; token rows replaced in each one's range
    specs = MOE_ADAPTER_SPECS if request.param == "qwen3_moe" else FORMAT_ADAPTER_SPECS
    adapters = {name: make_adapter(model_dir, **spec) for name, spec in specs.items()}
    return model_dir, adapters


def _small_budget(model_dir, adapters, world: int) -> int:
    """The smallest budget per device (in the sizes of one rank's share: half the KV heads,
    or as many when they are replicated) that holds the three adapters' rank-rows and
    KV's floor (one request of ``MAX_MODEL_LEN``) beside them: the 8 requests, which need
    more, are preempted on one process and on two."""
    plan = ShardPlan(ModelConfig.from_pretrained(model_dir), world, 0)
    shard, rows = plan.local_config(), device_rows(model_dir, adapters, plan)
    floor = MAX_MODEL_LEN // BLOCK_SIZE
    for num_blocks in itertools.count(floor):
        layout = RowLayout.for_model(shard, num_blocks, BLOCK_SIZE)
        if layout.total_rows >= rows and layout.kv_limit_for(layout.total_rows - rows) >= floor:
            arena = DeviceArena(shard, 1, BLOCK_SIZE, torch.float32, "cpu")
            return num_blocks * arena.bytes_per_block


def _run(engine: Engine, requests) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds of the same staggered requests: the second hits the first's prefixes."""
    first = run_staggered(engine, requests, MAX_TOKENS)
    hits = engine.kv.prefix_cache_hits
    second = run_staggered(engine, requests, MAX_TOKENS)
    assert engine.kv.prefix_cache_hits > hits > 0
    return first, second


def test_two_ranks_give_one_process_s_and_peft_s_tokens(model_and_adapters):
    model_dir, adapters = model_and_adapters
    requests = [(SYSTEM + prompt, adapter) for prompt, adapter in mixed_requests(8)]
    outputs, preemptions = {}, {}
    for world in (1, 2):
        engine = build_engine(
            model_dir,
            adapters,
            tensor_parallel_size=world,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=_small_budget(model_dir, adapters, world),
        )
        try:
            put_adapters_on_device(engine, adapters)  # KV left its floor: preemption
            outputs[world] = _run(engine, requests)
            preemptions[world] = engine.num_preemptions
            assert engine.kv.num_used_blocks == 0
            if world == 2:
                assert_matches_reference(
                    engine, model_dir, adapters, requests, outputs[2][1], MAX_TOKENS
                )
        finally:
            engine.close()
    assert preemptions[1] > 0 and preemptions[2] > 0, preemptions
    assert outputs[2] == outputs[1]


def test_a_killed_rank_fails_the_next_step_naming_it(tiny_model_dir):
    engine = build_engine(tiny_model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=20)
    try:
        (rank,) = engine.devices._ranks
        os.kill(rank.process.pid, signal.SIGKILL)
        rank.process.wait(10)
        with pytest.raises(RankFailed, match=r"rank 1 \(exit code -9\)"):
            engine.generate(["Hello"], SamplingParams(max_tokens=4))
    finally:
        engine.close()


HEARTBEAT_TIMEOUT_S = 2.0


def test_a_rank_stopped_in_a_generate_is_named_within_its_heartbeat_timeout(
    tiny_model_dir, monkeypatch
):
    """SIGSTOP on rank 1 in the middle of a generate leaves rank 0 waiting in the step's
    first all-reduce, with rank 1's connections open: its heartbeat's silence names it and
    ends the wait long before the collective's own timeout. Nothing is left behind."""
    before = child_pids(os.getpid())
    engine = build_engine(
        tiny_model_dir,
        tensor_parallel_size=2,
        tensor_parallel_timeout_s=30,
        tensor_parallel_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    (rank,) = engine.devices._ranks
    send, steps, stopped_at = engine.devices.send, [], []

    def send_then_stop_rank_1(command):
        send(command)
        steps.extend([command] if isinstance(command, RunStep) else [])
        if len(steps) == 3 and not stopped_at:  # the third step of the generate
            os.kill(rank.process.pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    monkeypatch.setattr(engine.devices, "send", send_then_stop_rank_1)
    try:
        with pytest.raises(RankFailed, match=r"rank 1 stopped answering \(no heartbeat for"):
            engine.generate(["Hello"], SamplingParams(max_tokens=16, ignore_eos=True))
        waited = time.monotonic() - stopped_at[0]
        assert waited < 3 * HEARTBEAT_TIMEOUT_S, waited
        assert rank.process.poll() is not None  # killed by rank 0's watch
    finally:
        if rank.process.poll() is None:
            os.kill(rank.process.pid, signal.SIGCONT)
        engine.close()
    assert child_pids(os.getpid()) == before


def test_an_idle_engine_outlives_its_collective_timeout(tiny_model_dir):
    """The other ranks wait for rank 0's next command as long as the engine is idle: the
    collective timeout bounds a step's waits, not the gaps between steps."""
    engine = build_engine(
        tiny_model_dir,
        tensor_parallel_size=2,
        tensor_parallel_timeout_s=2,
        tensor_parallel_heartbeat_timeout_s=1,
    )
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        (first,) = engine.generate(["Hello"], params)
        time.sleep(3)
        (second,) = engine.generate(["Hello"], params)
        assert second.token_ids == first.token_ids
    finally:
        engine.close()


def test_two_ranks_speculate_and_sample_as_one_process(tiny_model_dir, make_adapter):
    """n-gram speculation (proposals accepted and rejected) gives PEFT's greedy tokens over
    two ranks; seeded sampling with every option (penalties, top-k/top-p/min-p, a logit
    bias, logprobs of the output and of the prompt) gives one process's tokens and logprobs (the same steps on the same batch: only the all-reduce's order of
    additions differs, in the logits' last bits)."""
    adapters = {name: make_adapter(tiny_model_dir, **spec) for name, spec in ADAPTER_SPECS.items()}
    requests = mixed_requests(6)
    sampling = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={42: 3.0, 1000: -100.0},
        logprobs=2,
        prompt_logprobs=2,
        seed=11,
        ignore_eos=True,
    )
    sampled = {}
    for world in (1, 2):
        engine = build_engine(tiny_model_dir, adapters, tensor_parallel_size=world, **SPECULATIVE)
        try:
            if world == 2:
                greedy = run_staggered(engine, requests, 24)
                assert_speculated(engine)
                assert_matches_reference(engine, tiny_model_dir, adapters, requests, greedy, 24)
            outs = engine.generate(
                [prompt for prompt, _ in requests],
                sampling,
                adapters=[adapter for _, adapter in requests],
            )
            sampled[world] = [(o.token_ids, o.logprobs + o.prompt_logprobs[1:]) for o in outs]
        finally:
            engine.close()
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(sampled[1], sampled[2], strict=True):
        assert tokens_2 == tokens_1 and 1000 not in tokens_2
        for one, two in zip(logprobs_1, logprobs_2, strict=True):  # output, then prompt
            assert [t for t, _ in one.top] == [t for t, _ in two.top]
            assert abs(one.logprob - two.logprob) < 1e-4
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(one.top, two.top, strict=True))


def test_an_engine_that_cannot_start_leaves_no_rank_behind(tiny_model_dir):
    before = child_pids(os.getpid())
    with pytest.raises(ValueError, match="KV blocks"):
        build_engine(tiny_model_dir, tensor_parallel_size=2, kv_cache_bytes=4096)
    assert child_pids(os.getpid()) == before
    # A split the model does not allow is refused before any rank starts.
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        build_engine(tiny_model_dir, tensor_parallel_size=3)
    assert child_pids(os.getpid()) == before


def test_two_ranks_decode_over_the_static_buffers_as_one_process(
    tiny_model_dir, make_adapter, monkeypatch
):
    """The static decode path (CUDA graphs on GPUs) over two ranks: both build their
    buffers, and each decode-only step runs on every rank at the same bucket (in Triton's
    interpreter here, eagerly; a GPU replays each rank's graph). Steps of 3 decodes run in
    bucket 4 with a padding row: a rank running it at another size would enter the
    all-reduces with other shapes and fail the step, and a padding row written to a real
    slot on either rank would change the tokens."""
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")  # the ranks inherit it
    adapters = {name: make_adapter(tiny_model_dir, **spec) for name, spec in ADAPTER_SPECS.items()}
    requests = mixed_requests(6)
    max_tokens = [9, 6, 5, 4, 3, 2]
    outputs = {}
    for world in (1, 2):
        engine = build_engine(
            tiny_model_dir,
            adapters,
            tensor_parallel_size=world,
            block_size=BLOCK_SIZE,
            cuda_graph_max_batch=4,
            max_num_seqs=8,
        )
        try:
            static = engine.executor.static_decode
            assert static is not None and engine.arena.scratch_blocks == 1
            outputs[world] = run_ragged(engine, requests, max_tokens)
            assert {bucket for bucket, _ in static.steps_run} == {1, 2, 4}, static.steps_run
        finally:
            engine.close()
    assert outputs[2] == outputs[1]
    for (prompt, adapter), n, got in zip(requests, max_tokens, outputs[2], strict=True):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        path = None if adapter is None else adapters[adapter]
        assert got == greedy_tokens(tiny_model_dir, path, prompt_ids, n), (prompt, adapter)


def test_a_failure_inside_rank_0_s_step_stops_the_engine_cleanly(tiny_model_dir):
    """Rank 0 raising between two layers leaves rank 1 waiting in the next layer's
    all-reduce: re-running parts of the step (isolation.py) would pair rank 0's new
    collectives with that stale one. The engine stops instead, naming the failure, and
    closing it leaves no rank behind."""
    before = child_pids(os.getpid())
    engine = build_engine(tiny_model_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=20)
    try:
        layer = engine.model.model.layers[1]

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault in layer 1")

        layer.forward = broken
        with pytest.raises(RankFailed, match=r"rank 0 failed inside a step .*injected fault"):
            engine.generate(["Hello"], SamplingParams(max_tokens=4))
        assert engine.devices.out_of_step
    finally:
        engine.close()
    assert child_pids(os.getpid()) == before
