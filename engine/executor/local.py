"""The local executor runs a ``StepBatch`` on one device: tensors in, sampled tokens out.

It holds the model, the KV cache tensors (the device arena's, shared with the adapter
pool), the adapter pool (as the source of adapter weights), the kernel backend (chosen
once by the engine: it turns the batch into the attention plan and LoRA metadata the model
takes) and the sampler; it makes no decisions. The batch is laid out already
(``step_batch.py``).

Non-finite values (an adapter whose weights overflow, a corrupted row) are caught per
request: every token's final hidden state is checked, and a step in which any is NaN or
infinite raises :class:`NonFiniteOutput` naming the requests whose tokens they were, after
the others were sampled. Each token attends to itself, so a non-finite key or value it
wrote to the KV cache shows in its own output: a request whose tokens all came out finite
wrote a sound cache. Checking needs no extra device sync: the sampler syncs anyway, and
the non-finite rows' logits are zeroed first so that sampling them cannot fail.

Structured outputs: the sampling rows whose sequence has a grammar get its mask of allowed
next tokens (``MaskFiller``, one call for all of them), applied by the sampler after the
logit bias and penalties. The masks are filled on this thread right after the forward is
launched, not on a background thread during it (``MaskFiller.submit``): on CUDA the
launch returns before the GPU is done, so the fill overlaps it anyway; on the CPU the
forward is synchronous, and ``benchmarks/structured_overhead/runner.py`` measured the fill at
0.16 ms a step for one row and 0.32 ms for eight, against steps of 63 and 129 ms: a
background fill could save at most that (0.25%), below the run-to-run noise, and its thread
would compete with torch's for the two cores. So the simpler path is the one kept. A step
with no constrained row fills nothing and builds nothing. Filling reads the matchers only:
they advance when the scheduler appends the sampled tokens, so a re-run of the step
(isolation.py) or a step cut short (step_interrupt.py) never advances one twice. The static
decode path (CUDA graphs) returns hidden states like the eager one: its logits are sampled,
and masked, here too.

Speculative decoding: a decode that verifies ``k`` proposed tokens lays out its last token
and then the proposals (``k + 1`` query rows over its cached prefix, as a prefill chunk
does); LoRA applies per token as for any row, so it shares the step with every other
request. Row ``i``'s logits give the token after the first ``i`` proposals; the sampler's
``verify`` accepts the proposals the target's own choice agrees with (greedy: equal to its
argmax; sampling: the rejection rule, so the output distribution is the target's) and
emits one more. The KV the step wrote for rejected proposals is past the sequence's
computed tokens: the scheduler's update drops those slots, and a later step overwrites them.

Prompt logprobs: the rows ``step_batch.PromptRows`` names go through the LM head in the passes
it cuts, and only each row's token logprob and top-k come back: the full ``[rows, vocab]``
logits are never held at once, and requests that don't ask pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.clock import WallClock
from loramux.engine.config import EngineConfig
from loramux.engine.executor.base import NonFiniteOutput, PromptLogprobs, StepResult
from loramux.engine.executor.forward import copy_kv_blocks, decode_step, forward_step, step_tokens
from loramux.engine.lora.backend import KernelBackend
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.tokens import StepTokens
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.model.llama import LlamaForCausalLM, LoRAWeightSource
from loramux.engine.model.loader import load_engine_model
from loramux.engine.native_decode import NativeDecode
from loramux.engine.sampler import Sampler, TokenLogprobs, logprobs_of
from loramux.engine.static_decode import StaticDecode
from loramux.engine.step_batch import PromptRows, SamplingRows, StepBatch
from loramux.engine.structured import MaskFiller, StepMasks


class LocalExecutor:
    """Runs step batches on one device (the ``Executor`` interface)."""

    interruptible = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lora_weights: LoRAWeightSource,
        backend: KernelBackend,
        sampler: Sampler,
        static_decode: StaticDecode | None = None,
        native_decode: NativeDecode | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.lora_weights = lora_weights
        self.backend = backend
        self.sampler = sampler
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # [num_blocks, block_size, kv_heads, head_dim] per layer, keys and values: the
        # device arena's tensors, whose top also holds the resident adapters' rows.
        self.kv_caches = kv_caches
        # Decode-only steps of up to its largest bucket run over its fixed buffers (CUDA
        # graphs on CUDA); every other step builds its tensors afresh.
        self.static_decode = static_decode
        # On the CPU, decode-only steps (plain LoRA included) in one native call.
        self.native_decode = native_decode
        self.interrupt: Callable[[], None] | None = None
        self._mask_filler: MaskFiller | None = None  # built at the first constrained step

    @torch.inference_mode()
    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        copy_kv_blocks(self.kv_caches, moves, self.device)

    def runs_static(self, batch: StepBatch) -> bool:
        """Whether the batch is decode-only and small enough for the static path."""
        return (
            self.static_decode is not None
            and batch.forward.is_decode_only
            and len(batch.forward.query_lens) <= self.static_decode.max_batch
            # DoRA's and LoRA biases' terms and adapters' token rows are applied by torch
            # ops sized on the host: such steps run eager
            and (batch.forward.lora is None or batch.forward.lora.plain)
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step: the samplers' tokens and the requested prompt logprobs.

        Raises ``NonFiniteOutput`` when some requests' tokens came out non-finite.
        """
        launched_before = self.backend.lora_launches.total
        tokens = step_tokens(self.model, self.lora_weights, batch.forward, self.device)
        if self.runs_static(batch):
            hidden = self.static_decode.run(decode_step(batch.forward))
        elif self.native_decode is not None and self.native_decode.runs(batch.forward):
            if self.interrupt is not None:
                self.interrupt()  # once, before it: the native step has no gaps between layers
            hidden = self.native_decode.run(batch.forward)
        else:
            hidden = forward_step(
                self.model,
                self.backend,
                self.kv_caches,
                self.lora_weights,
                self.block_size,
                self.device,
                batch.forward,
                self.interrupt,
                tokens,
            )
        sampling, verifying = batch.sampling, batch.verifying
        masks = self._grammar_masks(sampling) if sampling.constrained else None
        finite = torch.isfinite(hidden).all(dim=-1)  # [rows]
        sampled = {}
        # One LM-head pass for the sampling rows and the verifying ones: reading the head's
        # weights (vocab x hidden) dominates it, and a second pass cost a CPU step at batch
        # 4 a fifth of its time.
        index = torch.tensor(batch.head_index, dtype=torch.long, device=self.device)
        if len(index):
            # A non-finite row is failed below; zeroed, it samples harmlessly meanwhile.
            head = None if tokens is None else tokens.head(batch.head_index)
            all_logits = torch.where(
                finite[index, None], self.model.compute_logits(hidden[index], head), 0.0
            )
        if sampling.rows:
            logits = all_logits[: len(sampling.index)]
            result = self.sampler.sample(
                logits, sampling.rows, suppress_token_ids=sampling.suppress, masks=masks
            )
            sampled = {
                seq.request_id: [(token, logprobs)]
                for seq, token, logprobs in zip(
                    sampling.sequences, result.token_ids, result.logprobs, strict=True
                )
            }
        if verifying.groups:
            logits = all_logits[len(sampling.index) :]
            verified = self.sampler.verify(logits, verifying.groups)
            for seq, rows in zip(verifying.sequences, verified, strict=True):
                sampled[seq.request_id] = list(zip(rows.token_ids, rows.logprobs, strict=True))
        prompt_logprobs = self._prompt_logprobs(hidden, batch.prompt_rows, tokens)
        if not bool(finite.all()):
            bad = [
                rid for first, end, rid in batch.token_spans if not bool(finite[first:end].all())
            ]
            raise NonFiniteOutput(
                bad,
                {k: v for k, v in sampled.items() if k not in bad},
                {k: v for k, v in prompt_logprobs.items() if k not in bad},
            )
        launches = self.backend.lora_launches.total - launched_before
        return StepResult(sampled, prompt_logprobs, lora_launches=launches)

    def _grammar_masks(self, sampling: SamplingRows) -> StepMasks | None:
        """The masks of the sampling rows with a grammar (rows in ``sampling``'s order)."""
        if self._mask_filler is None:
            self._mask_filler = MaskFiller(
                self.model.config.vocab_size, pin_memory=self.device.type == "cuda"
            )
        return self._mask_filler.fill([seq.grammar for seq in sampling.sequences])

    def _prompt_logprobs(
        self, hidden: torch.Tensor, scored: PromptRows, tokens: StepTokens | None
    ) -> PromptLogprobs:
        """The scored rows' prompt logprobs from their raw logits, pass by pass."""
        if not scored.rows:
            return {}
        rows = torch.tensor(scored.rows, dtype=torch.long, device=self.device)
        targets = torch.tensor(scored.targets, dtype=torch.long, device=self.device)
        entries: list[TokenLogprobs] = []
        for lo, hi in scored.spans():
            head = None if tokens is None else tokens.head(scored.rows[lo:hi])
            logits = self.model.compute_logits(hidden[rows[lo:hi]], head)  # [<= pass, vocab]
            entries += logprobs_of(logits, targets[lo:hi], scored.top_counts[lo:hi])
        out: PromptLogprobs = {}
        for request_id, entry in zip(scored.request_ids, entries, strict=True):
            out.setdefault(request_id, []).append(entry)
        return out


class OneDevice:
    """The engine on one device (the ``Devices`` interface): its parts as they are."""

    shard = None  # the whole model
    group = None  # no collectives

    def __init__(self, device: torch.device, compute_threads: int | None):
        self.device = device
        self.clock = WallClock()
        self.compute_threads = compute_threads
        # On one CPU process, the threads follow the cores other processes leave free.
        self.governs_threads = device.type == "cpu"

    def load_model(self, config: EngineConfig, *, quant_op) -> LlamaForCausalLM:
        """The whole model (nothing to join)."""
        return load_engine_model(config, self.device, quant_op=quant_op)

    def close(self) -> None:
        """Nothing to stop."""

    def arena(self, *args, **kwargs) -> DeviceArena:
        return DeviceArena(*args, **kwargs)

    def adapter_rows(self, arena: DeviceArena) -> DeviceArena:
        return arena

    def static_decode(self, *args, capture: bool, **kwargs) -> StaticDecode:
        return StaticDecode(*args, capture=capture, **kwargs)

    def executor(self, local: Callable[[], LocalExecutor], pool: LoRAPool) -> LocalExecutor:
        return local()
