"""The CPU's lean decode step: decode-only steps run the decoder's layers in one native call
(``kernels/csrc/decode_cpu.c``) instead of some twenty torch ops a layer, their plain LoRA
adapters applied inside it from the pool's rows.

At batch 1 a small model's step on the CPU is mostly dispatch: SmolLM2-135M's 30 layers make
about 600 op calls for a few milliseconds of arithmetic. This is the CPU's counterpart of the
GPU's static decode path (``static_decode.py``): the same steps (one new token per sequence),
the same results as the eager forward up to float32 summation order, and the eager forward for
everything else (prefill chunks, speculative verification, steps whose adapters need more than
one pass of plain LoRA: DoRA, LoRA biases, token rows, experts, compositions).

It binds to a model it can run exactly: float32 on one CPU, Llama's layer (RMSNorm before
attention and MLP, RoPE of one kind, SiLU-gated MLP, optional projection biases), no sliding
window, no QK norm, no mixture of experts, projections packed (int4, int8) or float32, and an
unquantized KV cache. :func:`native_decode_for` says why it does not bind to another.
The step runs between the embedding and the final norm, which stay torch's; so do the LM
head and sampling. A native step is not interruptible between layers (it takes milliseconds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM, LlamaMLP, LoRAWeightSource
from loramux.engine.model.quantized import QuantizedLinear
from loramux.engine.model.rope import RotaryEmbedding
from loramux.engine.step_batch import ForwardInputs
from loramux.kernels.decode_native import (
    DecoderShape,
    LayerTensors,
    NativeDecodeLibrary,
    NativeDecoder,
    StepAdapters,
)
from loramux.kernels.lora_batch import LoRATable

logger = logging.getLogger(__name__)

PROJECTIONS = LORA_TARGETS


def unsupported(model: nn.Module, kv_caches) -> str | None:
    """Why the native decode cannot run this model, or None when it can."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not the engine's Llama decoder"
    config = model.config
    if model.ranks is not None:
        return "the model is sharded over ranks"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    if next(model.parameters()).dtype != torch.float32:
        return "the model is not float32"
    for flag, why in (
        (config.qk_norm, "it norms queries and keys"),
        (config.gemma_norms, "it has Gemma's norms"),
        (any(config.moe_layers), "it has a mixture of experts"),
        (config.hidden_act != "silu", f"its activation is {config.hidden_act}"),
        (config.num_heads % config.num_kv_heads != 0, "its heads do not share keys evenly"),
        (
            any(config.window_of(layer) is not None for layer in range(config.num_layers)),
            "it has sliding-window layers",
        ),
        (len({layer.rope_kind for layer in model.model.layers}) != 1, "its layers mix RoPE kinds"),
    ):
        if flag:
            return why
    for layer in model.model.layers:
        if not isinstance(layer.mlp, LlamaMLP):
            return "a layer's MLP is not Llama's"
        for name in PROJECTIONS:
            linear = model.projection(layer.self_attn.layer, name)
            if not isinstance(linear, QuantizedLinear | nn.Linear):
                return f"{name} is a {type(linear).__name__}"
    for keys, values in kv_caches:
        if type(keys) is not torch.Tensor or type(values) is not torch.Tensor:
            return "the KV cache is quantized"
        if keys.dtype != torch.float32 or values.dtype != torch.float32:
            return "the KV cache is not float32"
    return None


def _projection(linear: nn.Module):
    if isinstance(linear, QuantizedLinear):
        return linear.qweight, linear.bias
    return linear.weight.data, None if linear.bias is None else linear.bias.data


class NativeDecode:
    """Runs decode-only steps (plain LoRA adapters included) through the native forward."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        decoder: NativeDecoder,
        block_size: int,
        threads: Callable[[], int] = torch.get_num_threads,
    ):
        self.model = model
        self.decoder = decoder
        self.block_size = block_size
        self.threads = threads  # at each step: the engine's CPU threads follow the free cores
        self.rotary = RotaryEmbedding(
            model.config.for_layer_kind(model.model.layers[0].rope_kind), torch.device("cpu")
        )
        self.steps_run = 0

    def runs(self, inputs: ForwardInputs) -> bool:
        """Whether this step is one it runs: decode-only, its adapters (if any) plain LoRA
        in one pass (no DoRA, LoRA bias, token rows, experts or composition)."""
        if not inputs.is_decode_only:
            return False
        return inputs.lora is None or (self.decoder.has_adapters and inputs.lora.plain)

    def run(self, inputs: ForwardInputs) -> torch.Tensor:  # hidden states [T, hidden]
        model, block = self.model, self.block_size
        lens, block_tables = inputs.context_lens, inputs.block_tables
        positions = [n - 1 for n in lens]
        widest = max(len(table) for table in block_tables)
        # one tensor each, built from lists: this runs every decode step
        tables = torch.tensor(
            [table + [0] * (widest - len(table)) for table in block_tables], dtype=torch.int32
        )
        slots = torch.tensor(
            [
                table[p // block] * block + p % block
                for table, p in zip(block_tables, positions, strict=True)
            ],
            dtype=torch.long,
        )
        x = model.embed(torch.tensor(inputs.input_ids, dtype=torch.long)).contiguous()
        cos, sin = self.rotary.cos_sin(torch.tensor(positions, dtype=torch.long), x.dtype)
        self.decoder.run(
            x,
            cos.contiguous(),
            sin.contiguous(),
            slots,
            tables,
            torch.tensor(lens, dtype=torch.int32),
            self.threads(),
            None if inputs.lora is None else step_adapters(inputs.lora),
        )
        self.steps_run += 1
        return model.model.norm(x)


def step_adapters(table: LoRATable) -> StepAdapters:
    """The table's adapters as one row per token (a decode step's token is its sequence)."""
    first_rows = table.first_rows()
    modules = len(LORA_TARGETS)
    first_row, ranks, scales = [], [], []  # per token, made into one tensor each
    for start, end, adapter in table.spans:
        count = end - start
        if adapter is None:
            first_row += [-1] * count
            ranks += [[0] * modules] * count
            scales += [[0.0] * modules] * count
        else:
            first_row += [first_rows[adapter]] * count
            ranks += [[r[adapter] for r in table.ranks]] * count
            scales += [[c[adapter] for c in table.scales]] * count
    return StepAdapters(
        torch.tensor(first_row, dtype=torch.long),
        torch.tensor(ranks, dtype=torch.int32).reshape(-1, modules),
        torch.tensor(scales, dtype=torch.float32).reshape(-1, modules),
        table.max_rank,
    )


def _pools(pools: LoRAWeightSource | None, layer: int):
    """The layer's adapter pool views per module, or None without adapter rows."""
    if pools is None:
        return None
    try:
        return [(pools.a_pool(layer, m), pools.b_pool(layer, m)) for m in LORA_TARGETS]
    except KeyError:  # an arena without adapter rows
        return None


def native_decode_for(
    model: nn.Module,
    kv_caches,
    block_size: int,
    library: NativeDecodeLibrary | None,
    pools: LoRAWeightSource | None = None,
) -> NativeDecode | None:
    """The native decode over ``model`` and its cache, or None (logged why) where it cannot."""
    if library is None:
        return None
    reason = unsupported(model, kv_caches)
    if reason is not None:
        logger.info(
            "Decode steps run the torch forward: the native decode %s",
            f"does not take this model: {reason}",
        )
        return None
    config = model.config
    shape = DecoderShape(
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        inter=config.intermediate_size,
        block_size=block_size,
        eps=config.rms_norm_eps,
        scale=model.model.layers[0].self_attn.scale,
    )
    layers = []
    for index, (layer, (keys, values)) in enumerate(
        zip(model.model.layers, kv_caches, strict=True)
    ):
        projections = {
            name.removesuffix("_proj"): _projection(model.projection(index, name))
            for name in PROJECTIONS
        }
        layers.append(
            LayerTensors(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                projections,
                keys,
                values,
                _pools(pools, index),
            )
        )
    return NativeDecode(model, library.bind(shape, layers), block_size)
