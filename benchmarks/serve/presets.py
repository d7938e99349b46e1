"""``loramux bench``'s presets: one workload each, where it runs, and what it is judged by.

Each preset's ``description`` says what it serves, its ``baseline`` what loramux is
compared with (transformers + PEFT; for ``lora-overhead`` the same engine with no adapter,
for ``adapter-churn`` the same trace with every adapter resident, for ``speculative`` the
same engine without speculation), its ``goals`` what it is judged by and why.
``cpu-smoke``, ``engine-vs-peft``, ``adapter-churn``, ``lora-overhead`` and ``speculative``
run SmolLM2 on a CPU; ``slora-s1``, ``slora-s2`` and ``punica-distinct`` run on a CUDA GPU
at Llama-7B shapes with random bf16 weights (``bench_gpu``), next to the published figure
they are compared with. S-LoRA reports 6.69 req/s on S2 with 1,000
adapters on an A100-80GB; scaled by memory bandwidth (2.0 -> about 3.35 TB/s) parity on an
H100 is about 11 req/s, and the goal is 12. Punica reports 1,053 tok/s in its distinct
case (batch 32, every request its own rank-16 adapter, all loaded before the clock
starts); the goal is to beat it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from loramux.benchmarks.common.workload import TenantSpec, WorkloadSpec


@dataclass(frozen=True)
class Reference:
    """A published figure the preset's loramux figure is put next to."""

    system: str
    metric: str  # a key of measures.summarize's dict: "requests_per_s", "output_tokens_per_s"
    value: float
    setting: str  # the hardware and workload it was measured on


@dataclass(frozen=True)
class Goal:
    """loramux's figure ``metric`` must reach ``value`` (``strict``: exceed it); with
    ``at_most``, it must stay at or below ``value`` instead (``strict``: below it)."""

    metric: str
    value: float
    strict: bool = False
    why: str = ""
    at_most: bool = False

    def met_by(self, measured: float) -> bool:
        if self.at_most:
            return measured < self.value if self.strict else measured <= self.value
        return measured > self.value if self.strict else measured >= self.value

    @property
    def relation(self) -> str:
        """The comparison as a symbol: ``≥``, ``>``, ``≤`` or ``<``."""
        if self.at_most:
            return "<" if self.strict else "≤"
        return ">" if self.strict else "≥"


def judge_goals(
    goals: tuple[Goal, ...], figures: dict, *, unjudged: str | None, failed: str | None
) -> list[dict]:
    """Each goal with its measured figure (``figures[goal.metric]``) and verdict: ``met`` is
    None with the reason when the run cannot be judged (``unjudged``), False when requests
    failed (``failed`` says how many), else whether the figure meets the goal."""
    judged = []
    for goal in goals:
        measured = figures[goal.metric]
        if unjudged is not None:
            met, verdict = None, f"not judged: {unjudged}"
        elif failed is not None:
            met, verdict = False, f"not met: {failed}"
        else:
            met = goal.met_by(measured)
            verdict = "met" if met else "not met"
        judged.append(
            {
                **dataclasses.asdict(goal),
                "relation": goal.relation,
                "measured": measured,
                "met": met,
                "verdict": verdict,
            }
        )
    return judged


class Baseline(Enum):
    """What a preset's loramux figures are compared with."""

    PEFT = "transformers + PEFT"  # the same workload under transformers + PEFT
    BASE_MODEL = "base model"  # the same engine serving the same requests with no adapter
    ALL_RESIDENT = "all resident"  # the same engine and trace, every adapter on the device
    SPECULATION_OFF = "speculation off"  # the same engine config with speculative_method off
    NONE = "none"  # judged by its goals alone (fairness-slo)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workload: WorkloadSpec
    device: str = "cpu"  # "cpu" or "cuda"
    baseline: Baseline = Baseline.PEFT
    baseline_batch: int = 8  # PEFT's static batch size
    # The GPU runner's baseline: it serves the first ``baseline_requests`` requests (None:
    # all) and holds at most ``baseline_resident`` adapters (None: all) between batches.
    baseline_requests: int | None = None
    baseline_resident: int | None = None
    preload_adapters: bool = False  # every adapter on the device before the clock starts
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    references: tuple[Reference, ...] = ()
    goals: tuple[Goal, ...] = ()


# One H100 (80 GB): 13.5 GB of Llama-7B weights, 48 GiB shared by the KV cache (about 96k
# tokens of context) and the resident adapters, the rest for activations, CUDA graphs and
# the allocator. Host: 32 GiB of parsed adapters (about 500 of S2's mean rank 30, 67 MB
# each at rank 32) on a 128 GiB machine. 4 loader threads make ~10 adapters/s (S2 at
# 12 req/s needs ~4 new ones a second) and leave most of the 16 cores to the engine loop.
# Decode steps of up to max_num_seqs sequences replay CUDA graphs.
H100_ENGINE = {
    "kv_cache_bytes": 48 << 30,
    "adapter_host_bytes": 32 << 30,
    "adapter_load_workers": 4,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 4096,
    "cuda_graph_max_batch": 128,
}
SLORA_REFERENCE = Reference(
    system="S-LoRA",
    metric="requests_per_s",
    value=6.69,
    setting="A100-80GB, Llama-7B, S2, 1,000 adapters",
)
SLORA_GOAL = Goal(
    metric="requests_per_s",
    value=12.0,
    why="bandwidth-scaled parity with S-LoRA on an H100 is about 11 req/s",
)
PUNICA_REFERENCE = Reference(
    system="Punica",
    metric="output_tokens_per_s",
    value=1053.0,
    setting="Llama2-7B, distinct adapters, batch 32",
)
PUNICA_GOAL = Goal(metric="output_tokens_per_s", value=1053.0, strict=True, why="beat Punica")
ENGINE_VS_PEFT_GOAL = Goal(
    metric="ratio_engine_over_peft",
    value=5.0,
    why="the engine's tokens/s at least 5x transformers + PEFT's best batching",
)
CHURN_GOAL = Goal(
    metric="ratio_itl_p99",
    value=1.2,
    at_most=True,
    why="adapter churn costs at most 20% of the inter-token latency's P99",
)
LORA_OVERHEAD_GOAL = Goal(
    metric="lora_over_base_seconds",
    value=1.10,
    at_most=True,
    why="16 distinct adapters cost at most 10% over the base model on the same engine",
)

FAIRNESS_GOALS = (
    Goal(
        metric="share_max_deviation",
        value=0.10,
        at_most=True,
        why="each backlogged tenant's share of output tokens within ±10% of its weight's",
    ),
    Goal(
        metric="priority_ttft_p50_ratio",
        value=1.5,
        at_most=True,
        why="the priority tenant's median TTFT under the flood at most 1.5x its idle one",
    ),
    Goal(
        metric="priority_ttft_p99_ratio",
        value=3.0,
        at_most=True,
        why="the priority tenant's P99 TTFT under the flood at most 3x its idle one",
    ),
)
SPECULATIVE_GOALS = (
    Goal(
        metric="copy_speedup",
        value=1.5,
        why="n-gram speculation makes a copy-heavy workload at least 1.5x as fast",
    ),
    Goal(
        metric="chat_speedup",
        value=0.95,
        why="where there is little to copy it costs at most 5% (the draft length backs off)",
    ),
)


def _sixteen_at_once(**lengths) -> WorkloadSpec:
    """32 requests at once (the runner submits every one before stepping), request i on
    adapter i % 16 of ranks 8 and 16."""
    return WorkloadSpec(
        num_requests=32,
        rate=1e6,
        num_adapters=16,
        popularity="distinct",
        ranks=(8, 16),
        seed=0,
        **lengths,
    )


def _slora(name: str, ranks: tuple[int, ...], description: str, **judged) -> Preset:
    return Preset(
        name=name,
        description=description,
        workload=WorkloadSpec(
            num_requests=2000,
            rate=20.0,
            num_adapters=1000,
            popularity="power",
            popularity_param=0.3,
            ranks=ranks,
            input_len=(8, 512),
            output_len=(8, 512),
        ),
        device="cuda",
        baseline_batch=32,
        # PEFT serves 3 static batches: each runs to its longest output (~500 steps of
        # ~0.1 s with 20-30 adapters in the batch), so the whole trace would take most of
        # an hour; throughput at saturation is what is compared.
        baseline_requests=96,
        baseline_resident=64,
        slo_ttft_s=6.0,
        engine=H100_ENGINE,
        **judged,
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="cpu-smoke",
            description="SmolLM2-135M on this CPU: 48 requests, Poisson arrivals at 2/s, "
            "8 adapters (Zipf 1.0, ranks 8 and 16), two tenants of weights 2 and 1",
            workload=WorkloadSpec(
                num_requests=48,
                rate=2.0,
                cv=1.0,
                num_adapters=8,
                popularity="zipf",
                popularity_param=1.0,
                ranks=(8, 16),
                input_len=(16, 96),
                output_len=(8, 32),
                base_fraction=0.125,
                tenants=(
                    TenantSpec("gold", priority=5, weight=2.0, share=1.0),
                    TenantSpec("silver", priority=5, weight=1.0, share=1.0),
                ),
                seed=0,
            ),
            baseline_batch=8,
            slo_ttft_s=2.0,
            slo_itl_s=0.5,
            engine={"kv_cache_bytes": 256 << 20, "max_num_seqs": 32},
        ),
        Preset(
            name="engine-vs-peft",
            description="SmolLM2-135M on this CPU: 32 chat requests at once over 16 adapters "
            "(ranks 8 and 16, q/k/v/o or all seven modules; request i uses adapter i % 16), "
            "128 new tokens each (fixed length, greedy), served by the engine and by "
            "transformers + PEFT's mixed-adapter generate",
            workload=_sixteen_at_once(output_len=(128, 128)),
            engine={
                "kv_cache_bytes": 512 << 20,
                "max_num_seqs": 64,
                "max_num_batched_tokens": 2048,
            },
            goals=(ENGINE_VS_PEFT_GOAL,),
        ),
        Preset(
            name="adapter-churn",
            description="SmolLM2-135M on this CPU: 1,000 registered adapters (ranks 8/16/32 on "
            "q/k/v/o, bf16 on disk) of uniform popularity, 400 chat requests arriving as a "
            "Poisson process at 2/s, 24 tokens each, served with host and device adapter "
            "tiers far smaller than the adapters used, against the same trace with every "
            "used adapter resident",
            workload=WorkloadSpec(
                num_requests=400,
                rate=2.0,
                num_adapters=1000,
                popularity="uniform",
                ranks=(8, 16, 32),
                output_len=(24, 24),
                seed=0,
            ),
            baseline=Baseline.ALL_RESIDENT,
            engine={"max_num_seqs": 32, "max_model_len": 512},
            goals=(CHURN_GOAL,),
        ),
        Preset(
            name="lora-overhead",
            description="SmolLM2-135M on this CPU, one engine with default settings: 32 "
            "requests at once, 64 new tokens each (fixed length), prompts of 16 to 96 tokens, "
            "served by the base model alone and with 16 distinct adapters (ranks 8 and 16; "
            "q/k/v/o on 12, all seven modules on 4, half of each rank 8; request i uses "
            "adapter i % 16), in interleaved runs",
            workload=_sixteen_at_once(input_len=(16, 96), output_len=(64, 64)),
            baseline=Baseline.BASE_MODEL,
            goals=(LORA_OVERHEAD_GOAL,),
        ),
        _slora(
            "slora-s1",
            (8,),
            "S-LoRA S1 on Llama-7B shapes (random bf16 weights): saturating arrivals "
            "(20/s), lengths uniform in [8, 512], rank 8 on q/k/v/o, 1,000 adapters "
            "(power 0.3)",
        ),
        _slora(
            "slora-s2",
            (64, 32, 16, 8),
            "S-LoRA S2 on Llama-7B shapes (random bf16 weights): saturating arrivals "
            "(20/s), lengths uniform in [8, 512], ranks {64, 32, 16, 8} on q/k/v/o, 1,000 "
            "adapters (power 0.3)",
            references=(SLORA_REFERENCE,),
            goals=(SLORA_GOAL,),
        ),
        Preset(
            name="fairness-slo",
            description="SmolLM2-135M on this CPU over HTTP (the platform in-process, 8 "
            "slots): three tenants of priority 5 and weights 1, 2 and 4 each keep 6 streamed "
            "completions busy (40 prompt and 48 output tokens each; 18 streams on 8 slots) "
            "while a priority-9 tenant sends a short request (16 prompt, 8 output tokens) "
            "every 2 s; every request carries its deadline (`timeout`), and its SLO is a "
            "first token within the TTFT target and the end before the deadline",
            workload=WorkloadSpec(
                num_requests=1,  # closed loop: each stream sends its next request at once
                rate=1.0,
                input_len=(40, 40),
                output_len=(48, 48),
                tenants=(
                    TenantSpec("w1", priority=5, weight=1.0),
                    TenantSpec("w2", priority=5, weight=2.0),
                    TenantSpec("w4", priority=5, weight=4.0),
                    TenantSpec("priority", priority=9, weight=1.0),
                ),
            ),
            baseline=Baseline.NONE,
            engine={"max_num_seqs": 8},
            goals=FAIRNESS_GOALS,
        ),
        Preset(
            name="speculative",
            description="SmolLM2-135M on this CPU (float32, greedy, chat prompts): a "
            "copy-heavy workload (rewrite, repeat, extract from or correct a passage of about "
            "250 tokens) and a chat workload (open questions), at most 96 tokens a request "
            "(EOS ends it), at batch 1 and at 4 in flight (8 requests through 4 slots, each "
            "finished one replaced by the next), on two engines in one process alike but "
            "for n-gram speculation (prompt lookup, up to 4 proposals a step, adaptive draft "
            "length) against none; tokens/s of each, acceptance and tokens per step, and "
            "the output token ids checked identical",
            workload=WorkloadSpec(
                num_requests=4,  # per workload; a batch-b run serves 2b of them, b in flight
                rate=1e6,
                num_adapters=0,
                base_fraction=1.0,
                input_len=(40, 260),
                output_len=(96, 96),
            ),
            baseline=Baseline.SPECULATION_OFF,
            engine={
                "device": "cpu",
                "dtype": "float32",
                "kv_cache_bytes": 256 << 20,
                "enable_prefix_caching": False,  # every run computes its prompts alike
                "speculative_method": "ngram",
                "num_speculative_tokens": 4,
                "ngram_max_n": 4,
                "ngram_min_n": 2,
            },
            goals=SPECULATIVE_GOALS,
        ),
        Preset(
            name="punica-distinct",
            description="Punica's distinct case on Llama-7B shapes (random bf16 weights): "
            "32 requests at once, each its own rank-16 adapter on q/k/v/o (loaded before "
            "the clock starts), 128 prompt and 128 output tokens each, tokens/s",
            workload=WorkloadSpec(
                num_requests=32,
                rate=1e6,
                num_adapters=32,
                popularity="distinct",
                ranks=(16,),
                input_len=(128, 128),
                output_len=(128, 128),
            ),
            device="cuda",
            baseline_batch=32,
            baseline_resident=32,
            preload_adapters=True,
            engine=H100_ENGINE,
            references=(PUNICA_REFERENCE,),
            goals=(PUNICA_GOAL,),
        ),
    )
}
