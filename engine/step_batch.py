"""The step batch: the scheduler's plan for one step, laid out as the device runs it.

The scheduler decides who runs and how many tokens each (``SchedulerOutput``); this module
turns that into rows: the batch's token ids in the scheduler's order (grouped by adapter),
each sequence contributing the tokens ``[num_computed, num_computed + n)`` and then the
proposals it verifies; its block tables and context lengths; the step's adapter spans as
the pool's table; which rows sample, which verify proposals and which score prompt tokens;
and the LM-head passes those rows take. An executor (``engine/executor``) runs the batch:
nothing here touches a tensor, so a batch is built the same way for one device, for
several ranks and for a simulated device.

``ForwardInputs`` is the part every rank of a sharded model needs to run the same forward
and the same LM-head passes; the rest (the sampling rows, the sequences) stays on rank 0.

Prompt logprobs: the hidden state at position ``p`` gives the logits of token ``p + 1``, so
a chunk ``[start, end)`` of a request that asks for them yields the entries of prompt tokens
``start + 1 .. end`` (the first token of a chunk was scored by the previous chunk's last
position). Entries a sequence already has (computed before a preemption) are not scored
again. Each request's rows go through the LM head in passes of their own, at most
``PROMPT_LOGPROB_ROWS`` rows each: a matrix multiply's last bits for a row depend on where
in the matrix the row sits, so passes shared by several requests gave a request prompt
logprobs that depended on its neighbours in the step, and ``[256, vocab]`` float32 logits
are already 50 MB for a 49k vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.engine.lora.mix import AdapterSpans
from loramux.engine.sampler import SamplingRow
from loramux.engine.scheduler import ScheduledSequence, SchedulerOutput
from loramux.engine.sequence import Sequence
from loramux.engine.speculative.verify import VerifyGroup
from loramux.kernels.lora_batch import LoRATable

PROMPT_LOGPROB_ROWS = 256  # LM-head rows per prompt-logprob pass


@dataclass(frozen=True)
class ForwardInputs:
    """One forward over the paged KV cache, and the LM-head passes after it: what every
    rank of a sharded model runs alike (``engine/parallel``), and all a device needs.

    Rows are the batch's tokens in order; sequence ``s`` owns a contiguous run of
    ``query_lens[s]`` of them, the last ones of its context of ``context_lens[s]`` tokens.
    """

    input_ids: list[int]  # [rows]
    block_tables: list[list[int]]  # [sequences][blocks]: KV block of each block_size tokens
    context_lens: list[int]  # [sequences]: tokens in context after the step, rows included
    query_lens: list[int]  # [sequences]: rows the step computes for each
    lora: LoRATable | None  # the step's adapters (``LoRAPool.step_table``); None if none
    head_rows: list[list[int]]  # the hidden rows of each LM-head pass, in order

    @property
    def is_decode_only(self) -> bool:
        """One row per sequence: the static decode path (CUDA graphs) can run it."""
        return bool(self.query_lens) and all(n == 1 for n in self.query_lens)


@dataclass(frozen=True)
class PromptRows:
    """The rows whose logits score a prompt token: the hidden row, the token it scores,
    how many alternatives to return and whose it is (request ids, in row order)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top_counts: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)

    def spans(self, size: int = PROMPT_LOGPROB_ROWS) -> list[tuple[int, int]]:
        """``[lo, hi)`` index ranges of ``rows``: one request's each, at most ``size``."""
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

    def passes(self, size: int = PROMPT_LOGPROB_ROWS) -> list[list[int]]:
        """The rows in LM-head passes, as :meth:`spans` cuts them."""
        return [self.rows[lo:hi] for lo, hi in self.spans(size)]

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


@dataclass(frozen=True)
class SamplingRows:
    """The sequences that sample one token, in row order, with what the sampler needs."""

    index: list[int] = field(default_factory=list)  # each one's hidden row: its last token
    sequences: list[Sequence] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    suppress: list[list[int]] = field(default_factory=list)  # token ids it may not sample yet

    @property
    def constrained(self) -> bool:
        """Some row has a grammar (structured outputs): the step fills masks."""
        return any(seq.grammar is not None for seq in self.sequences)


@dataclass(frozen=True)
class VerifyRows:
    """The sequences that verify proposals (speculative decoding), in group order."""

    index: list[int] = field(default_factory=list)  # rows: the last token's and each proposal's
    sequences: list[Sequence] = field(default_factory=list)
    groups: list[VerifyGroup] = field(default_factory=list)


@dataclass(frozen=True)
class StepBatch:
    """One step's work, as an executor runs it (see the module doc).

    ``scheduled`` is the plan's items in row order: an executor that models the device
    instead of running it (a simulation) reads its shape from them.
    """

    scheduled: list[ScheduledSequence]
    forward: ForwardInputs
    token_spans: list[tuple[int, int, str]]  # (first row, end row, request id) per sequence
    sampling: SamplingRows
    verifying: VerifyRows
    prompt_rows: PromptRows

    @property
    def num_rows(self) -> int:
        return len(self.forward.input_ids)

    @property
    def head_index(self) -> list[int]:
        """The rows of the one LM-head pass that samples: sampling rows, then verifying."""
        return self.sampling.index + self.verifying.index


def build_step_batch(
    plan: SchedulerOutput,
    block_table: Callable[[str], list[int]],
    lora_table: Callable[[AdapterSpans], LoRATable | None],
) -> StepBatch:
    """``plan`` laid out as rows: ``block_table(request_id)`` gives a sequence's KV blocks,
    ``lora_table(spans)`` the step's adapters (``LoRAPool.step_table``: it also counts the
    step for the adapters' recency)."""
    input_ids: list[int] = []
    token_spans: list[tuple[int, int, str]] = []
    tables, context_lens, query_lens = [], [], []
    spans: AdapterSpans = []
    sampling, verifying, prompt_rows = SamplingRows(), VerifyRows(), PromptRows()
    for item in plan.scheduled:
        seq = item.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
        first = len(input_ids)
        prompt_rows.add(item, first)
        input_ids.extend(seq.all_token_ids[start:end])
        drafts = item.draft_token_ids
        input_ids.extend(drafts)  # positions end .. end + k - 1, after the last token
        token_spans.append((first, len(input_ids), seq.request_id))
        tables.append(block_table(seq.request_id))
        context_lens.append(end + len(drafts))
        query_lens.append(item.num_query_tokens)
        if spans and spans[-1][2] == seq.lora_key:
            spans[-1] = (spans[-1][0], len(input_ids), seq.lora_key)
        else:
            spans.append((first, len(input_ids), seq.lora_key))
        if item.samples and drafts:
            verifying.index.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
            verifying.sequences.append(seq)
            verifying.groups.append(verify_group(seq, drafts))
        elif item.samples:
            sampling.index.append(len(input_ids) - 1)
            sampling.sequences.append(seq)
            sampling.rows.append(
                SamplingRow(
                    params=seq.params,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    generator=seq.generator,
                )
            )
            sampling.suppress.append(seq.suppressed_token_ids())
    head = sampling.index + verifying.index
    # The LM-head passes the step makes, in order (a sharded model's ranks make them
    # together): the sampling and verifying rows, then each request's prompt-logprob rows.
    head_rows = ([head] if head else []) + prompt_rows.passes()
    forward = ForwardInputs(
        input_ids, tables, context_lens, query_lens, lora_table(spans), head_rows
    )
    return StepBatch(list(plan.scheduled), forward, token_spans, sampling, verifying, prompt_rows)


def verify_group(seq: Sequence, drafts: list[int]) -> VerifyGroup:
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
