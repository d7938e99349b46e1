"""The executor interface: what runs a step batch, wherever the device is.

The engine decides (scheduler, KV manager, adapter residency); an executor carries the
decisions out on the device and reports what the step computed. It is chosen once, where
the engine is built (``engine/executor/__init__.py``): one device (``LocalExecutor``),
the ranks of a sharded model (``engine/parallel/executor.py``), or a model of a device
that advances a clock instead of running kernels. Nothing above it knows which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loramux.engine.sampler import TokenLogprobs
from loramux.engine.step_batch import StepBatch

if TYPE_CHECKING:
    import torch

    from loramux.engine.clock import Clock
    from loramux.engine.config import EngineConfig
    from loramux.engine.executor.local import LocalExecutor
    from loramux.engine.lora.pool import LoRAPool
    from loramux.engine.memory.arena import AdapterRows, DeviceArena
    from loramux.engine.model.llama import LlamaForCausalLM
    from loramux.engine.parallel.shard import ShardPlan
    from loramux.engine.static_decode import StaticDecode

# request id -> the (token, logprobs) it emitted: one, or with speculation the accepted
# proposals and one more
Sampled = dict[str, list[tuple[int, TokenLogprobs | None]]]
PromptLogprobs = dict[str, list[TokenLogprobs]]  # request id -> the step's new entries


@dataclass
class StepResult:
    """What one step computed: sampled tokens, and the prompt logprobs of the prompt
    tokens it scored (for the requests that ask for them)."""

    sampled: Sampled
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)
    # LoRA op launches the step's forward made (``lora.backend.LaunchCount``); None where
    # nothing is launched (a simulated device)
    lora_launches: int | None = None


class NonFiniteOutput(RuntimeError):
    """The step computed NaN or infinite values for some requests' tokens."""

    def __init__(
        self,
        request_ids: list[str],
        sampled: Sampled,
        prompt_logprobs: PromptLogprobs | None = None,
    ):
        super().__init__(
            f"the model computed non-finite values (NaN or infinity) for {len(request_ids)} "
            "request(s)"
        )
        self.request_ids = request_ids
        self.sampled = sampled  # request id -> (token, logprobs) of every other sampler
        self.prompt_logprobs = prompt_logprobs or {}  # of every other request


class Executor(Protocol):
    """Runs step batches, and copies KV blocks the scheduler moved.

    ``execute`` raises :class:`NonFiniteOutput` naming the requests whose tokens came out
    non-finite (the others' results in it stand); any other exception fails the step, and
    the engine finds the request that caused it by running parts (``isolation.py``) unless
    the executor says the engine itself is down (``EngineDown``).
    """

    # Checked between layers of a step that may be cut short (``step_interrupt.py``); set
    # by the engine before each run, None when the step must finish.
    interrupt: Callable[[], None] | None

    @property
    def interruptible(self) -> bool:
        """Whether a step may be left midway (not when other ranks would wait for it)."""
        ...

    def execute(self, batch: StepBatch) -> StepResult:
        """Run the batch: its forward, its LM-head passes, its sampling."""
        ...

    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` (keys and values of every layer), before anything
        reads them; the destinations are free, so no pair overlaps another."""
        ...


class Devices(Protocol):
    """Where the engine runs: one device (``local.OneDevice``), the ranks of a sharded
    model (``engine/parallel/ranks.EngineRanks``), or a simulated GPU
    (``engine/simulation/devices.SimulatedDevice``). Chosen once, where the engine is
    built, it builds the device side the engine's owners use, each part doing on every
    device what the engine asks of one."""

    device: torch.device  # this process's (where the engine's own tensors live)
    clock: Clock  # the time the engine records and decides by
    shard: ShardPlan | None  # this process's part of the model (None: all of it)
    compute_threads: int | None  # this process's CPU threads (None: the machine's default)
    governs_threads: bool  # whether the threads follow the cores other processes leave

    def load_model(self, config: EngineConfig, *, quant_op) -> LlamaForCausalLM:
        """``config``'s model as this process holds it (its shard, joined to the others'
        collectives; in simulation its geometry alone)."""
        ...

    def close(self) -> None:
        """Stop whatever runs beside this process (the other ranks)."""
        ...

    def arena(self, *args, **kwargs) -> DeviceArena:
        """The KV cache and adapter rows' memory (``DeviceArena``'s arguments)."""
        ...

    def adapter_rows(self, arena: DeviceArena) -> AdapterRows:
        """What the adapter pool writes rows through."""
        ...

    def static_decode(self, *args, capture: bool, **kwargs) -> StaticDecode:
        """The static decode path (``StaticDecode``'s arguments)."""
        ...

    def executor(self, local: Callable[[], LocalExecutor], pool: LoRAPool) -> Executor:
        """The executor the engine runs its steps with: over ``local()``, this device's
        (a simulated device builds none and reads the adapters' ranks from ``pool``)."""
        ...
