"""LoRA on a mixture's experts, both forms the engine runs, against the multi-slice
references over an expert's rows (``expert_lora.expert_batch``), computed in float64.

Three experts, a step of 11 tokens over four adapters: two with LoRA on the experts (each
expert's ranks 3 and 5, rows of their own further into the pool), one whose experts carry
none (its attention LoRA is no business of these ops), and tokens with no adapter. The
experts are narrower than the dense MLP the slots are sized for, so each form must cut
the pools to the expert's widths. Every expert and both projection groups (gate and up as
two slices, down as one) are run; rows outside the adapters' are NaN, so a form that
reads a wrong row fails. The Triton form runs in Triton's interpreter without a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loramux.engine.lora.expert_lora import (
    MLP_MODULES,
    StepExpertLoRA,
    expert_adapters,
    expert_batch,
    token_owners,
)
from loramux.engine.model.llama import LORA_TARGETS
from loramux.kernels.lora import lora_expand_slices_reference, lora_shrink_slices_reference
from loramux.kernels.lora_batch import LoRATable
from tests.kernels.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, EXPERT_INTER, DENSE_INTER, EXPERTS, POOL_ROWS = 24, 12, 20, 3, 64
LAYER = 0
# (start, end, adapter): adapters 0 and 2 have expert LoRA, 1 has none, gaps have no adapter
SPANS = [(0, 3, 0), (3, 5, 1), (5, 6, None), (6, 10, 2), (10, 11, 0)]
EXPERT_RANKS = [3, 0, 5, 0]  # adapter 3: in the table, used by no token
ADAPTER_ROWS = [list(range(2, 11)), list(range(11, 15)), list(range(30, 45)), [50]]


class Pools:
    """The MLP slots' pools of one layer (a ``LoRAWeightSource``'s two methods)."""

    def __init__(self, dtype, generator):
        widths = {"gate_proj": (HIDDEN, DENSE_INTER), "up_proj": (HIDDEN, DENSE_INTER)}
        widths["down_proj"] = (DENSE_INTER, HIDDEN)
        used = [r for a, rank in enumerate(EXPERT_RANKS) if rank for r in ADAPTER_ROWS[a]]
        self.a, self.b = {}, {}
        for module, (fan_in, fan_out) in widths.items():
            for store, width in ((self.a, fan_in), (self.b, fan_out)):
                pool = torch.full((POOL_ROWS, width), float("nan"), dtype=dtype)
                pool[used] = torch.randn(len(used), width, generator=generator).to(dtype)
                store[module] = pool.to(DEVICE)

    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.a[module]

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.b[module]


def step_table() -> LoRATable:
    scales = [[0.5, 1.0, -2.0, 1.0] for _ in LORA_TARGETS]
    scales[LORA_TARGETS.index("down_proj")] = [0.25, 1.0, 1.5, 1.0]
    ranks = [[2, 4, 3, 1] for _ in LORA_TARGETS]
    return LoRATable(SPANS, ADAPTER_ROWS, ranks, scales, 11, expert_ranks=list(EXPERT_RANKS))


def expected(x, outs, pools, table, tokens, expert, modules):
    """The references over the expert's batch, in float64, on the pools cut to its widths."""
    adapters = expert_adapters(table)
    owners = torch.tensor(token_owners(table, adapters), device=DEVICE)
    batch = expert_batch(owners, tokens, adapters, expert)
    a_pools = [pools.a_pool(LAYER, m)[:, : x.shape[1]].double().nan_to_num() for m in modules]
    b_pools = [
        pools.b_pool(LAYER, m)[:, : o.shape[1]].double().nan_to_num()
        for m, o in zip(modules, outs, strict=True)
    ]
    first = MLP_MODULES.index(modules[0])
    y = lora_shrink_slices_reference(x.double(), a_pools, batch, first_slice=first)
    out = torch.cat([o.double() for o in outs], dim=1)
    offsets = [sum(o.shape[1] for o in outs[:s]) for s in range(len(outs))]
    lora_expand_slices_reference(out, y, b_pools, offsets, batch, first_slice=first)
    return out.split([o.shape[1] for o in outs], dim=1)


def triton_form(table, pools):
    from loramux.engine.lora.triton_backend import TritonBackend

    backend = TritonBackend(torch.device(DEVICE))
    step = backend.lora_step(table, pools)
    return backend.expert_lora_step(table, step, pools, DEVICE), step


@pytest.mark.parametrize("form", ["torch", "triton"])
@pytest.mark.parametrize("expert", range(EXPERTS))
def test_expert_lora_equals_the_references_over_the_experts_rows(form, expert):
    generator = torch.Generator().manual_seed(7 + expert)
    dtype = torch.float32
    pools, table = Pools(dtype, generator), step_table()
    if form == "torch":
        experts, step = StepExpertLoRA.for_step(table, pools, DEVICE), None
    else:
        experts, step = triton_form(table, pools)
    # The expert's tokens: a few of each kind, in step order as the router gives them.
    tokens = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10], device=DEVICE)
    for modules, fan_in, fan_out in (
        (("gate_proj", "up_proj"), HIDDEN, EXPERT_INTER),
        (("down_proj",), EXPERT_INTER, HIDDEN),
    ):
        x = torch.randn(len(tokens), fan_in, generator=generator).to(DEVICE, dtype)
        outs = [torch.randn(len(tokens), fan_out, generator=generator).to(DEVICE, dtype)]
        outs += [torch.randn_like(outs[0]) for _ in modules[1:]]
        want = expected(x, outs, pools, table, tokens, expert, modules)
        experts.add(x, outs, tokens, LAYER, expert, modules)
        for got, reference in zip(outs, want, strict=True):
            assert_close(got, reference, 1e-5)
    if step is not None:
        assert step.launches == 2 * 3  # a zeroing, a shrink and an expand per group


def test_tokens_without_expert_lora_are_left_alone():
    generator = torch.Generator().manual_seed(3)
    pools, table = Pools(torch.float32, generator), step_table()
    tokens = torch.tensor([3, 4, 5], device=DEVICE)  # adapter 1 (no expert LoRA), none
    for experts in (StepExpertLoRA.for_step(table, pools, DEVICE), triton_form(table, pools)[0]):
        x = torch.randn(3, HIDDEN, generator=generator).to(DEVICE)
        out = torch.randn(3, EXPERT_INTER, generator=generator).to(DEVICE)
        before = out.clone()
        experts.add(x, [out, out.clone()], tokens, LAYER, 1, ("gate_proj", "up_proj"))
        assert torch.equal(out, before)


def test_no_expert_lora_in_the_step_is_no_op():
    table = dataclasses.replace(step_table(), expert_ranks=None)
    assert StepExpertLoRA.for_step(table, None, DEVICE) is None
    assert expert_adapters(table) == []
