"""Draft-model proposals: a smaller model sharing the tokenizer guesses the next k tokens.

The draft runs on the engine's device with the engine's kernels, over a paged KV cache of
its own (``DraftCache``: its own tensors and block lists, nothing shared with the target's
arena). For the requests that speculate this step it runs ``max k`` batched forwards:

* round 0 catches every request up: the tokens its cache has not seen (the whole prompt the
  first time, afterwards the accepted tokens and the one the target emitted), one ragged
  prefill over its cached prefix; the last position's logits give ``d_0``;
* round ``i`` feeds ``d_{i-1}`` (one query token a request, decodes only) for the requests
  still drafting, and gives ``d_i``.

A greedy request takes the draft's argmax (its proposals are point masses: greedy
verification only compares them with the target's argmax). A sampling request draws
``d_i`` from ``q_i = softmax(z_i / T)`` with its own temperature, and hands ``q_i`` to the
verifier (``Sequence.draft_probs``): the rejection rule is exact for any ``q`` as long as
the draft really was drawn from it. The draws use a generator of the draft's own, seeded
from the request's seed when it has one, so a seeded request's proposals, and therefore
its output, do not depend on the rest of the batch, and the target's stream is untouched.

What the cache holds is checked, not assumed: after proposing, a request's cache holds its
tokens and, tentatively, ``d_0 .. d_{k-2}`` (the last draft is never fed). Before the next
proposal the tentative tokens are compared with what the request actually appended, and
only the agreeing prefix is kept: a rejection, a step the scheduler shortened, a step cut
short by a higher-priority arrival or a stop string all leave the cache consistent with no
bookkeeping elsewhere. Positions past the kept prefix are written again before any read.

Memory: the cache's blocks are freed when a request leaves the running set (finished,
aborted or preempted; a preempted one catches up again when it returns). A request whose
blocks do not fit this step simply proposes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.quantized import parameter_count
from loramux.engine.sampler import make_generator

if TYPE_CHECKING:
    from loramux.engine.lora.backend import KernelBackend
    from loramux.engine.sequence import Sequence

# Mixed into a seeded request's seed for its draft generator, so the draft's draws are not
# the target's own stream.
DRAFT_SEED_SALT = 0x5EED_D4AF


def _parameters(model: torch.nn.Module) -> int:
    return parameter_count(model)  # a quantized target's packed weights count as floats


class DraftModelError(ValueError):
    """The draft model cannot serve this target (the message says why)."""


def check_draft_model(draft: LlamaForCausalLM, target: LlamaForCausalLM, max_model_len: int):
    """Raise ``DraftModelError`` unless ``draft`` can propose for ``target``."""
    d = draft.config
    if draft.vocab_size != target.vocab_size:  # the whole model's, when target is a shard
        raise DraftModelError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens and the target's "
            f"{target.vocab_size}: a draft model must share the target's tokenizer"
        )
    if d.max_context < max_model_len:
        raise DraftModelError(
            f"the draft model handles {d.max_context} positions, fewer than the "
            f"engine's max_model_len {max_model_len}: lower max_model_len or pick another draft"
        )


class DraftCache:
    """The draft's paged KV cache: per-layer tensors and a free list of blocks."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int):
        c = model.config
        param = next(model.parameters())
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=param.dtype, device=param.device),
                torch.zeros(shape, dtype=param.dtype, device=param.device),
            )
            for _ in range(c.num_layers)
        ]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend ``blocks`` to cover ``num_tokens`` positions; False (unchanged) when the
        free blocks are too few."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            blocks.append(self._free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()


@dataclass
class DraftState:
    """One request's place in the draft cache."""

    blocks: list[int] = field(default_factory=list)
    confirmed: int = 0  # leading tokens of the request whose KV the cache holds
    tentative: list[int] = field(default_factory=list)  # drafts fed after them
    generator: torch.Generator | None = None  # a seeded request's own

    def sync(self, token_ids: Seq[int]) -> None:
        """Keep the tentative tokens the request actually appended, drop the rest; the
        last token is always fed again (its logits give the next draft)."""
        kept = 0
        for fed, actual in zip(self.tentative, token_ids[self.confirmed :], strict=False):
            if fed != actual:
                break
            kept += 1
        self.confirmed = min(self.confirmed + kept, len(token_ids) - 1)
        self.tentative = []


@dataclass
class _Drafting:
    """A request being drafted for in this call."""

    seq: Sequence
    k: int
    state: DraftState
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftModelProposer:
    """Proposes tokens with a draft model; one instance per engine."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: KernelBackend,
        *,
        num_blocks: int,
        block_size: int,
        seed: int,
    ):
        self.model = model
        self.backend = backend
        self.cache = DraftCache(model, num_blocks, block_size)
        param = next(model.parameters())
        self.device = param.device
        self._shared_generator = make_generator(seed ^ DRAFT_SEED_SALT, self.device)
        self._states: dict[str, DraftState] = {}
        # What one draft token costs relative to one target step: decoding reads the
        # weights, so about the ratio of the parameter counts (set by the engine).
        self.relative_cost = 0.0

    def cost_relative_to(self, target: LlamaForCausalLM) -> None:
        """Set ``relative_cost`` from the two models' parameter counts."""
        self.relative_cost = _parameters(self.model) / _parameters(target)

    @property
    def num_cached_requests(self) -> int:
        return len(self._states)

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.release(state.blocks)

    def forget_all_but(self, request_ids: Iterable[str]) -> None:
        """Free the cache of every request not in ``request_ids`` (the running ones)."""
        keep = set(request_ids)
        for rid in [rid for rid in self._states if rid not in keep]:
            self.forget(rid)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> None:
        """Set ``draft_token_ids`` (and ``draft_probs`` for sampling requests) of each
        ``(seq, k)`` in ``wants``: up to ``k`` tokens, none when its blocks do not fit."""
        drafting = []
        for seq, k in wants:
            state = self._state(seq)
            tokens = seq.all_token_ids
            state.sync(tokens)
            # Positions up to len + k - 2 are written (d_{k-1} is never fed).
            if self.cache.grow(state.blocks, len(tokens) + k - 1):
                drafting.append(_Drafting(seq, k, state))
        if not drafting:
            return
        feeds = [d.seq.all_token_ids[d.state.confirmed :] for d in drafting]
        bases = [len(d.seq.all_token_ids) for d in drafting]
        logits = self._forward(
            [t for feed in feeds for t in feed],
            [d.state.blocks for d in drafting],
            bases,
            [len(feed) for feed in feeds],
        )
        self._draw(drafting, logits)
        for i in range(1, max(d.k for d in drafting)):
            more = [d for d in drafting if d.k > i]
            logits = self._forward(
                [d.tokens[-1] for d in more],
                [d.state.blocks for d in more],
                [len(d.seq.all_token_ids) + i for d in more],
                [1] * len(more),
            )
            self._draw(more, logits)
        for d, base in zip(drafting, bases, strict=True):
            d.state.confirmed = base
            d.state.tentative = d.tokens[: d.k - 1]
            d.seq.draft_token_ids = d.tokens
            d.seq.draft_probs = torch.stack(d.probs) if d.probs else None

    def _state(self, seq: Sequence) -> DraftState:
        state = self._states.get(seq.request_id)
        if state is None:
            seed = seq.params.seed
            generator = (
                None if seed is None else make_generator(seed ^ DRAFT_SEED_SALT, self.device)
            )
            state = self._states[seq.request_id] = DraftState(generator=generator)
        return state

    def _forward(self, input_ids, tables, context_lens, query_lens) -> torch.Tensor:
        """The draft's logits at each request's last fed position: [requests, vocab]."""
        attention = self.backend.plan_attention(
            tables, context_lens, query_lens, self.cache.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, attention, self.cache.kv_caches)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last]).float()

    def _draw(self, drafting: list[_Drafting], logits: torch.Tensor) -> None:
        """Each request's next draft from its row of ``logits``."""
        # Every row's argmax in one transfer (greedy rows use it; on CUDA an int() per
        # row would wait for the device once per request).
        argmax = logits.argmax(dim=-1).tolist()
        for d, z, best in zip(drafting, logits, argmax, strict=True):
            params = d.seq.params
            if params.greedy:
                d.tokens.append(best)
                continue
            q = torch.softmax(z / params.temperature, dim=-1)
            generator = d.state.generator or self._shared_generator
            d.tokens.append(int(torch.multinomial(q, 1, generator=generator)))
            d.probs.append(q)
