"""The runner executes a ``SchedulerOutput``: tensors in, sampled tokens out.

It holds the model, the KV cache tensors (the device arena's, shared with the adapter
pool), the adapter pool, the kernel backend (chosen once by the engine: it turns the step
into the attention plan and LoRA metadata the model takes) and the sampler; it makes no
decisions. The batch is laid out in
the scheduler's order (grouped by adapter), each sequence contributing the tokens
``[num_computed, num_computed + n)``.

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
forward is synchronous, and ``benchmarks/structured_overhead.py`` measured the fill at
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

Prompt logprobs: the hidden state at position ``p`` gives the logits of token ``p + 1``, so
a chunk ``[start, end)`` of a request that asks for them yields the entries of prompt tokens
``start + 1 .. end`` (the first token of a chunk was scored by the previous chunk's last
position). Only those rows go through the LM head, each request's own passes of at most
``PROMPT_LOGPROB_ROWS`` (so its logprobs do not depend on the requests beside it), and
only each row's token logprob and top-k come back: the full ``[rows, vocab]`` logits are
never held at once, and requests that don't ask pay nothing. Entries a sequence already has
(computed before a preemption) are not computed again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loramux.engine.lora.backend import KernelBackend
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.model.llama import LlamaForCausalLM, LoRAWeightSource
from loramux.engine.sampler import Sampler, SamplingRow, TokenLogprobs, logprobs_of
from loramux.engine.scheduler import ScheduledSequence, SchedulerOutput
from loramux.engine.speculative.verify import VerifyGroup
from loramux.engine.static_decode import DecodeStep, StaticDecode
from loramux.engine.structured import MaskFiller, StepMasks
from loramux.kernels.kv_quant import QuantizedKV, bytes_per_slot_head, storage_dtype
from loramux.kernels.lora_batch import LoRATable

# LM-head rows per prompt-logprob chunk: [256, vocab] float32 logits are 50 MB for a 49k vocab.
PROMPT_LOGPROB_ROWS = 256

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


def kv_block_bytes(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one KV block takes across all layers (keys and values; with a quantized
    cache, its 8-bit data and per-slot scales: ``DeviceArena.bytes_per_block``)."""
    c = model.config
    storage = storage_dtype(kv_cache_dtype)
    if storage is None:
        per_head = c.head_dim * dtype.itemsize
    else:
        per_head = bytes_per_slot_head(c.head_dim, storage)
    return 2 * c.num_layers * c.num_kv_heads * per_head * block_size


def copy_kv_blocks(kv_caches, moves: list[tuple[int, int]], device: torch.device) -> None:
    """Copy KV blocks ``src -> dst`` (keys and values of every layer); the destinations
    were free, so no pair overlaps another."""
    if not moves:
        return
    src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=device)
    for caches in kv_caches:  # [num_blocks, block_size, kv_heads, head_dim] each
        for cache in caches:
            # A quantized cache's blocks as raw bytes: data and scales in one copy.
            blocks = cache.raw if isinstance(cache, QuantizedKV) else cache
            blocks.index_copy_(0, dst, blocks.index_select(0, src))


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lora_pool: LoRAPool,
        backend: KernelBackend,
        sampler: Sampler,
        block_tables,  # callable: request_id -> list[int]
        static_decode: StaticDecode | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.lora_pool = lora_pool
        self.backend = backend
        self.sampler = sampler
        self._block_table = block_tables
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # [num_blocks, block_size, kv_heads, head_dim] per layer, keys and values: the
        # device arena's tensors, whose top also holds the resident adapters' rows.
        self.kv_caches = kv_caches
        # Decode-only steps of up to its largest bucket run over its fixed buffers (CUDA
        # graphs on CUDA); every other step builds its tensors afresh.
        self.static_decode = static_decode
        # Checked between layers of an eager step (engine/step_interrupt.py); set by the engine.
        self.interrupt: Callable[[], None] | None = None
        self._mask_filler: MaskFiller | None = None  # built at the first constrained step

    @torch.inference_mode()
    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` for the scheduler's moves (:func:`copy_kv_blocks`)."""
        copy_kv_blocks(self.kv_caches, moves, self.device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run one step: the samplers' tokens and the requested prompt logprobs.

        Raises ``NonFiniteOutput`` when some requests' tokens came out non-finite.
        """
        input_ids: list[int] = []
        token_spans: list[tuple[int, int, str]] = []  # (first, end, request id) per sequence
        tables, context_lens, query_lens = [], [], []
        spans: list[tuple[int, int, int | None]] = []
        sample_index: list[int] = []
        sampling: list = []  # the sequences that sample, in row order
        rows: list[SamplingRow] = []
        suppress: list[list[int]] = []
        constrained = False  # some sampling row has a grammar
        scored = _PromptRows()
        verifying: list = []  # the sequences that verify proposals, in group order
        groups: list[VerifyGroup] = []
        verify_index: list[int] = []  # their rows: the last token's and each proposal's
        for item in output.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
            first = len(input_ids)
            scored.add(item, first)
            input_ids.extend(seq.all_token_ids[start:end])
            drafts = item.draft_token_ids
            input_ids.extend(drafts)  # positions end .. end + k - 1, after the last token
            token_spans.append((first, len(input_ids), seq.request_id))
            tables.append(self._block_table(seq.request_id))
            context_lens.append(end + len(drafts))
            query_lens.append(item.num_query_tokens)
            if spans and spans[-1][2] == seq.adapter_id:
                spans[-1] = (spans[-1][0], len(input_ids), seq.adapter_id)
            else:
                spans.append((first, len(input_ids), seq.adapter_id))
            if item.samples and drafts:
                verify_index.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
                verifying.append(seq)
                groups.append(_verify_group(seq, drafts))
            elif item.samples:
                sample_index.append(len(input_ids) - 1)
                sampling.append(seq)
                rows.append(
                    SamplingRow(
                        params=seq.params,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids,
                        generator=seq.generator,
                    )
                )
                suppress.append(seq.suppressed_token_ids())
                constrained = constrained or seq.grammar is not None

        long = {"dtype": torch.long, "device": self.device}
        table = self.lora_pool.step_table(spans)
        head = sample_index + verify_index  # the rows of the one LM-head pass below
        # The LM-head passes the step makes, in order (a sharded model's ranks make them
        # together): the sampling and verifying rows, then prompt logprob chunks.
        head_rows = ([head] if head else []) + scored.chunks(PROMPT_LOGPROB_ROWS)
        if self._is_static(query_lens):
            step = DecodeStep(input_ids, context_lens, tables, table)
            hidden = self._static_forward(step, head_rows)
        else:
            hidden = self._forward(input_ids, tables, context_lens, query_lens, table, head_rows)
        masks = self._grammar_masks(sampling) if constrained else None
        finite = torch.isfinite(hidden).all(dim=-1)  # [tokens]
        sampled = {}
        # One LM-head pass for the sampling rows and the verifying ones: reading the head's
        # weights (vocab x hidden) dominates it, and a second pass cost a CPU step at batch
        # 4 a fifth of its time.
        index = torch.tensor(head, **long)
        if len(index):
            # A non-finite row is failed below; zeroed, it samples harmlessly meanwhile.
            all_logits = torch.where(
                finite[index, None], self.model.compute_logits(hidden[index]), 0.0
            )
        if rows:
            logits = all_logits[: len(sample_index)]
            result = self.sampler.sample(logits, rows, suppress_token_ids=suppress, masks=masks)
            sampled = {
                seq.request_id: [(token, logprobs)]
                for seq, token, logprobs in zip(
                    sampling, result.token_ids, result.logprobs, strict=True
                )
            }
        if groups:
            logits = all_logits[len(sample_index) :]
            for seq, verified in zip(verifying, self.sampler.verify(logits, groups), strict=True):
                sampled[seq.request_id] = list(
                    zip(verified.token_ids, verified.logprobs, strict=True)
                )
        prompt_logprobs = self._prompt_logprobs(hidden, scored)
        if not bool(finite.all()):
            bad = [rid for first, end, rid in token_spans if not bool(finite[first:end].all())]
            raise NonFiniteOutput(
                bad,
                {k: v for k, v in sampled.items() if k not in bad},
                {k: v for k, v in prompt_logprobs.items() if k not in bad},
            )
        return StepResult(sampled, prompt_logprobs)

    def _grammar_masks(self, sampling: list) -> StepMasks | None:
        """The masks of the sampling rows with a grammar (rows in ``sampling``'s order)."""
        if self._mask_filler is None:
            self._mask_filler = MaskFiller(
                self.model.config.vocab_size, pin_memory=self.device.type == "cuda"
            )
        return self._mask_filler.fill([seq.grammar for seq in sampling])

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: _PromptRows) -> PromptLogprobs:
        """The scored rows' prompt logprobs from their raw logits, chunk by chunk."""
        if not scored.rows:
            return {}
        rows = torch.tensor(scored.rows, dtype=torch.long, device=self.device)
        targets = torch.tensor(scored.targets, dtype=torch.long, device=self.device)
        entries: list[TokenLogprobs] = []
        for lo, hi in scored.spans(PROMPT_LOGPROB_ROWS):
            logits = self.model.compute_logits(hidden[rows[lo:hi]])  # [<= chunk, vocab]
            entries += logprobs_of(logits, targets[lo:hi], scored.top_counts[lo:hi])
        out: PromptLogprobs = {}
        for request_id, entry in zip(scored.request_ids, entries, strict=True):
            out.setdefault(request_id, []).append(entry)
        return out

    def _is_static(self, query_lens: list[int]) -> bool:
        """Whether the step is decode-only and small enough for the static path."""
        return (
            self.static_decode is not None
            and 0 < len(query_lens) <= self.static_decode.max_batch
            and all(n == 1 for n in query_lens)
        )

    def _static_forward(self, step: DecodeStep, head_rows: list[list[int]]) -> torch.Tensor:
        """A decode-only step's hidden states over the static buffers (``head_rows``: as
        in ``_forward``)."""
        return self.static_decode.run(step)

    def _forward(
        self, input_ids, tables, context_lens, query_lens, table, head_rows
    ) -> torch.Tensor:
        """The step's hidden states over tensors built for it (any mix of tokens).

        ``head_rows``: the hidden rows of each LM-head pass ``execute`` makes next, which a
        tensor-parallel runner's other ranks must make with it (``engine/parallel``).
        """
        return forward_step(
            self.model,
            self.backend,
            self.kv_caches,
            self.lora_pool,
            self.block_size,
            self.device,
            input_ids,
            tables,
            context_lens,
            query_lens,
            table,
            self.interrupt,
        )


def forward_step(
    model: LlamaForCausalLM,
    backend: KernelBackend,
    kv_caches,
    pools: LoRAWeightSource,
    block_size: int,
    device: torch.device,
    input_ids: list[int],
    tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    table: LoRATable | None,
    interrupt: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Hidden states of one step over tensors built for it: its attention plan and LoRA
    metadata from ``backend``, adapters read from ``pools`` (what every rank of a sharded
    model runs too, over its own shard: ``engine/parallel/worker.py``)."""
    attention = backend.plan_attention(tables, context_lens, query_lens, block_size, device)
    lora = None if table is None else backend.lora_step(table, pools)
    input_tensor = torch.tensor(input_ids, dtype=torch.long, device=device)
    return model(input_tensor, attention, kv_caches, lora, interrupt)


def _verify_group(seq, drafts: list[int]) -> VerifyGroup:
    """``seq``'s rows for verifying ``drafts``: row i samples the token after the first i
    proposals, so its penalties and ``min_tokens`` count them as output already."""
    outputs = list(seq.output_token_ids)
    rows, suppress = [], []
    for i in range(len(drafts) + 1):
        rows.append(
            SamplingRow(
                params=seq.params,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=outputs + drafts[:i],
                generator=seq.generator,
            )
        )
        suppress.append(seq.suppressed_token_ids(num_more=i))
    # A draft model's q for the proposals verified (the scheduler may verify a prefix).
    probs = None if seq.draft_probs is None else seq.draft_probs[: len(drafts)]
    return VerifyGroup(
        rows=rows, suppress_token_ids=suppress, draft_token_ids=list(drafts), draft_probs=probs
    )


class _PromptRows:
    """The rows of a step whose logits score a prompt token, gathered as the batch is laid
    out: the hidden row, the token it scores, how many alternatives, and whose it is."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.top_counts: list[int] = []
        self.request_ids: list[str] = []

    def chunks(self, size: int) -> list[list[int]]:
        """The rows in LM-head passes (as ``_prompt_logprobs`` makes them): each request's
        own, at most ``size`` at a time. A matrix multiply's last bits for a row depend on
        where in the matrix the row sits, so passes shared by several requests gave one
        prompt logprobs that depended on its neighbours in the step."""
        return [self.rows[lo:hi] for lo, hi in self.spans(size)]

    def spans(self, size: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` index ranges of ``rows``, one request's and at most ``size`` each."""
        spans: list[tuple[int, int]] = []
        lo = 0
        for hi in range(1, len(self.rows) + 1):
            if (
                hi == len(self.rows)
                or self.request_ids[hi] != self.request_ids[lo]
                or hi - lo == size
            ):
                spans.append((lo, hi))
                lo = hi
        return spans

    def add(self, item: ScheduledSequence, first: int) -> None:
        """Add ``item``'s rows (its chunk's first token is hidden row ``first``)."""
        seq = item.seq
        if not seq.collects_prompt_logprobs:
            return
        start = seq.num_computed_tokens
        # Position p scores prompt token p + 1; entries up to len(...) - 1 are in hand.
        lo = max(start, len(seq.prompt_logprobs) - 1)
        hi = min(start + item.num_tokens, len(seq.prompt_token_ids) - 1)
        for position in range(lo, hi):
            self.rows.append(first + position - start)
            self.targets.append(seq.prompt_token_ids[position + 1])
            self.top_counts.append(seq.params.prompt_logprobs)
            self.request_ids.append(seq.request_id)
