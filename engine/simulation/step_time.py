"""How long a step would take on a GPU: a roofline per part of the forward, with the
device profile's efficiencies and fixed costs.

Per layer, for a step of T token rows:

    projections  max(W / (B * e_lin), 2 * P * T / (F * e_mm)) + the layer's small ops
    attention    decode rows: context * kv_token_bytes / (B * e_attn)
                 prefill chunks of q rows over c tokens: max(bytes / B, 4 * q * (c - q/2) * H / (F * e_pf))
    LoRA         per target group in the step (q/k/v fused, o, gate/up fused, down):
                 2 launches + max(adapter bytes / (B * e_lin), flops / (F * e_mm))

W: the layer's weight bytes, P its parameters, B the bandwidth, F the matmul rate, H the
hidden size. That is the device's time, which a decode-only step of at most
``cuda_graph_max_batch`` rows takes as a CUDA graph replay. Any other step runs eagerly, as
the engine does, and then takes at least the host's time to launch its ops, layer by layer
(the recorded eager steps cost the same with 8 KV heads as with 32: launch-bound). On top:
the LM head over the sampled rows, the host's work per step and per sequence, and the
copies the step waited for (adapter rows host -> device, KV blocks moved on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.model.config import ModelConfig
from loramux.engine.simulation.profile import DeviceProfile

# The LoRA launches of the recorded H100 runs the profile was fitted to: each group one
# shrink and one expand per layer. The engine now makes one fused launch per group for
# decode-sized steps (lora_triton_fused); until a GPU measures those, the simulator keeps
# modelling the kernels it was calibrated on.
LORA_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on."""

    decode_contexts: list[int]  # context length of each decoding sequence
    prefill_chunks: list[tuple[int, int]]  # (rows, context after the chunk) per prefill
    head_rows: int  # rows through the LM head (sampled)
    # per adapter in the step: (its tokens, module -> rank) for the modules it targets
    adapters: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    graph: bool = False  # replayed from a CUDA graph
    h2d_bytes: int = 0  # adapter rows copied in before the step
    device_copy_bytes: int = 0  # KV blocks and adapter rows moved on the device

    @property
    def tokens(self) -> int:
        return len(self.decode_contexts) + sum(rows for rows, _ in self.prefill_chunks)

    @property
    def sequences(self) -> int:
        return len(self.decode_contexts) + len(self.prefill_chunks)


@dataclass(frozen=True)
class StepTime:
    """A step's modelled seconds, by part."""

    parts: dict[str, float]
    # The adapters' bytes alone at the full memory bandwidth: the least time any kernel could
    # add for them (their floor; not a part of the step's time).
    lora_bytes_s: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


class StepTimeModel:
    def __init__(self, profile: DeviceProfile, model: ModelConfig, dtype_bytes: int):
        self.profile, self.model, self.dtype_bytes = profile, model, dtype_bytes
        shapes = {m: model.module_shape(m) for group in LORA_GROUPS.values() for m in group}
        self._shapes = shapes
        self._layer_params = sum(i * o for i, o in shapes.values())
        kv_dim = model.num_kv_heads * model.head_dim
        self._kv_token_bytes = 2 * kv_dim * dtype_bytes  # one layer's key and value

    def _roofline(self, nbytes: float, flops: float, memory_eff: float, compute_eff: float):
        p = self.profile
        return max(
            nbytes / (p.hbm_bytes_per_s * memory_eff),
            flops / (p.matmul_flops_per_s * compute_eff),
        )

    def step(self, shape: StepShape) -> StepTime:
        p, m, db = self.profile, self.model, self.dtype_bytes
        layers, tokens = m.num_layers, shape.tokens
        if tokens == 0:
            return StepTime({})
        projections = self._roofline(
            self._layer_params * db,
            2 * self._layer_params * tokens,
            p.linear_memory_efficiency,
            p.matmul_efficiency,
        )
        decode_bytes = sum(shape.decode_contexts) * self._kv_token_bytes
        attention = decode_bytes / (p.hbm_bytes_per_s * p.attention_memory_efficiency)
        hidden = m.num_heads * m.head_dim
        for rows, context in shape.prefill_chunks:
            flops = 4 * rows * max(context - rows / 2, 1) * hidden
            attention += self._roofline(
                context * self._kv_token_bytes, flops, 1.0, p.prefill_attention_efficiency
            )
        per_group = [self._lora_group(group, shape) for group in LORA_GROUPS.values()]
        groups = [seconds for seconds, _ in per_group]
        lora = sum(groups)
        lora_bytes = sum(nbytes for _, nbytes in per_group)
        head_params = m.vocab_size * m.hidden_size
        device = layers * (projections + attention + lora + p.layer_overhead_s)
        launches = 0.0
        if not shape.graph:
            lora_launches = 2 * sum(1 for g in groups if g)
            launch = p.layer_launch_eager_s + lora_launches * p.lora_launch_eager_s
            launches = max(0.0, layers * launch - device)
        parts = {
            "projections": layers * projections,
            "attention": layers * attention,
            "lora": layers * lora,
            "layer_overhead": layers * p.layer_overhead_s,
            "eager_launches": launches,  # the host's launches, past the device's time
            "lm_head": self._roofline(
                head_params * db,
                2 * head_params * shape.head_rows,
                p.linear_memory_efficiency,
                p.matmul_efficiency,
            ),
            "host": p.host_step_s + p.host_sequence_s * shape.sequences,
            "adapter_copies": shape.h2d_bytes / p.h2d_bytes_per_s,
            "device_copies": shape.device_copy_bytes / p.hbm_bytes_per_s,
        }
        return StepTime(parts, lora_bytes_s=layers * lora_bytes / p.hbm_bytes_per_s)

    def _lora_group(self, modules: tuple[str, ...], shape: StepShape) -> tuple[float, int]:
        """One layer's shrink and expand launches for the group's modules: their seconds
        and the adapters' bytes they read."""
        nbytes = flops = 0
        for tokens, ranks in shape.adapters:
            for module in modules:
                rank = ranks.get(module, 0)
                if rank:
                    width = sum(self._shapes[module])  # in + out
                    nbytes += rank * width * self.dtype_bytes
                    flops += 2 * tokens * rank * width
        if not nbytes:
            return 0.0, 0
        p = self.profile
        seconds = 2 * p.lora_launch_graph_s + self._roofline(
            nbytes, flops, p.linear_memory_efficiency, p.matmul_efficiency
        )
        return seconds, nbytes
