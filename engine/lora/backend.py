"""The kernel backend: chosen once when the engine is built, handed to what runs ops.

A backend turns a step into the two objects the model takes (``loramux.engine.model.llama``):

* ``plan_attention(...)``: a :class:`~loramux.engine.model.llama.StepAttention` (the step's
  plan of its own kind, and its attention op);
* ``lora_step(table, pools)``: a :class:`~loramux.engine.model.llama.StepLoRA` from the
  pool's table of the step's adapters (which rows, ranks and scales; the pool decides
  residency, the backend only reads);
* ``quant_linear``: the matmul of quantized projections (``model/quantized.py``), handed to
  the model when it is loaded.

Two backends: Triton (``loramux.engine.lora.triton_backend``: SGMV/BGMV and paged
attention kernels, CUDA graphs for decode) and torch (``loramux.engine.lora.torch_backend``:
the CPU's). :func:`select_backend` picks one from the device, the dtype and
``LORAMUX_KERNELS`` (read there, once); nothing downstream looks at the environment or at
which form a step took.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.engine.lora.expert_lora import StepExpertLoRA
from loramux.engine.model.llama import LoRAWeightSource, StepAttention, StepLoRA
from loramux.engine.model.quantized import QuantLinearOp
from loramux.kernels.dispatch import KERNELS_ENV, resolve_kernels
from loramux.kernels.lora_batch import LoRATable
from loramux.kernels.paged_attention import TRITON_DTYPES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundAttention:
    """A plan and the op that reads it (a ``StepAttention``)."""

    plan: object  # AttentionPlan or TritonAttentionPlan: whichever ``op`` takes
    op: Callable  # (query, k_cache, v_cache, plan, scale, window=None) -> out

    @property
    def positions(self) -> torch.Tensor:
        return self.plan.positions

    @property
    def new_token_slots(self) -> torch.Tensor:
        return self.plan.new_token_slots

    def attend(self, query, k_cache, v_cache, scale: float, window: int | None = None):
        return self.op(query, k_cache, v_cache, self.plan, scale, window=window)


class LaunchCount:
    """The LoRA op launches a backend's steps have made since it was built (each step adds
    its own as it runs; a replayed CUDA graph adds what its capture launched)."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, launches: int) -> None:
        self.total += launches


class KernelBackend(ABC):
    name: str
    # Whether decode-only steps can run over fixed buffers (CUDA graphs): the attention and
    # LoRA ops must read the step from device tensors, sizing no work on the host.
    static_decode: bool
    lora_launches: LaunchCount
    # The CPU's native decode forward (kernels/decode_native.py) and row ops of long steps
    # (kernels/rows_native.py), where this backend has them.
    native_decode = None
    native_rows = None

    @abstractmethod
    def plan_attention(
        self,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> StepAttention: ...

    @abstractmethod
    def lora_step(self, table: LoRATable, pools: LoRAWeightSource) -> StepLoRA: ...

    @property
    @abstractmethod
    def quant_linear(self) -> QuantLinearOp: ...

    def expert_lora_step(self, table: LoRATable, step: StepLoRA, pools, device):
        """The step's LoRA on a mixture's experts (``expert_lora.py``), None without any;
        torch ops unless the backend has kernels for it."""
        return StepExpertLoRA.for_step(table, pools, device)


def select_backend(
    device: torch.device, dtype: torch.dtype, choice: str | None = None
) -> KernelBackend:
    """The backend for ``device`` and ``dtype``: ``choice`` (default: ``LORAMUX_KERNELS``,
    else ``auto``, which is Triton on CUDA and torch elsewhere).

    ``auto`` falls back to torch for a dtype the Triton kernels do not take; an explicit
    ``triton`` refuses it. On a float32 CPU engine ``auto``'s torch backend applies LoRA with
    the native op (``loramux.kernels.lora_native``) where it builds; an explicit ``torch``
    keeps to torch ops (to bisect a suspected bug in the native op). The same holds for the
    quantized matmul (``loramux.kernels.quant_native``).
    """
    if choice is None:
        choice = os.environ.get(KERNELS_ENV)
    name = resolve_kernels(choice, device)
    explicit = (choice or "").strip().lower()
    if name == "triton" and dtype not in TRITON_DTYPES:
        if explicit == "triton":
            raise ValueError(
                f"{KERNELS_ENV}=triton: the Triton kernels take "
                f"{', '.join(map(str, TRITON_DTYPES))}, not {dtype}"
            )
        name = "torch"
    if name == "triton":
        from loramux.engine.lora.triton_backend import TritonBackend  # imports triton

        return TritonBackend(device)
    from loramux.engine.lora.torch_backend import TorchBackend

    if explicit in ("", "auto") and torch.device(device).type == "cpu" and dtype == torch.float32:
        return TorchBackend(device, *_native_cpu_ops())
    return TorchBackend(device)


def _native_cpu_ops():
    """The CPU's native ops for ``auto`` on a float32 CPU engine: LoRA, the quantized matmul,
    the read of an 8-bit KV cache, the decode forward (``engine/native_decode.py``), the
    row ops of long steps and prefill attention, each None where it does not build (logged why). All
    are built here, even those a model may not use (a second or less, once per machine):
    the model is loaded after the backend is chosen."""
    from loramux.kernels.attention_native import load_native_prefill_attention
    from loramux.kernels.decode_native import load_native_decode
    from loramux.kernels.kv_native import load_native_kv_gather
    from loramux.kernels.lora_native import load_native_lora
    from loramux.kernels.quant_native import load_native_quant_linear
    from loramux.kernels.rows_native import load_native_rows

    ops = []
    for load, fallback in (
        (load_native_lora, "LoRA on the CPU uses the stacked torch ops (slower)"),
        (load_native_quant_linear, "Quantized weights on the CPU use the torch ops (slower)"),
        (load_native_kv_gather, "An 8-bit KV cache on the CPU is read by the torch ops (slower)"),
        (load_native_decode, "Decode steps on the CPU run the torch forward (slower)"),
        (load_native_rows, "Norms and activations of prefill steps use the torch ops (slower)"),
        (load_native_prefill_attention, "Prefill attention on the CPU uses torch's SDPA (slower)"),
    ):
        native, how = load()
        if native is None:
            logger.warning("%s: %s", fallback, how)
        else:
            logger.info("Native CPU op: %s", how)
        ops.append(native)
    return ops
