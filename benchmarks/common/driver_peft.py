"""Serve a workload with transformers + PEFT: the static-batching baseline.

A ``PeftModel`` holds the adapters (all of them, or those ``AdapterSwapper`` swaps in)
and a batch mixes them with PEFT's ``generate(..., adapter_names=[...])``; a base-model
request uses PEFT's ``"__base__"``. Prompts are left-padded, with an attention mask over
the padding. Rules of ``serve_static_batches``, the loop itself:

* times are seconds from the run's start (``time.perf_counter() - t0``, taken after the
  model is loaded and warmed up with a 2-token generate); ``arrival_s`` comes from the
  workload;
* static batches: requests are grouped in arrival order into batches of ``batch_size``;
  a batch starts when its last request has arrived and the previous batch has finished
  (the driver sleeps until then); ``sent_s`` is its start, for every request in it;
* a batch generates ``max(output_len)`` of its requests, greedy, with EOS suppressed
  (``min_new_tokens = max_new_tokens``); each request keeps exactly its first
  ``output_len`` tokens. Token ``k`` of every request in the batch is stamped with the
  time generation step ``k`` ended (a ``StoppingCriteria`` that never stops, called once
  per step; on CUDA it synchronizes first), and ``finish_s`` is the stamp of the
  request's last token, i.e. as if tokens were streamed out: a short request is not
  charged for the rest of its batch, but the next batch waits for the longest one;
* a batch whose ``generate`` raises gets the error on all its records; the run goes on.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from loramux.benchmarks.common.measures import RequestRecord, new_records
from loramux.benchmarks.common.workload import WorkloadRequest

BASE_ADAPTER = "__base__"  # PEFT's adapter_names entry for "no adapter"
BatchHook = Callable[[Sequence[WorkloadRequest], Sequence[WorkloadRequest]], None]


def peft_adapter_name(k: int) -> str:
    """The name workload adapter ``k`` is loaded under in the PeftModel."""
    return f"a{k}"


def adapter_names(batch: Sequence[WorkloadRequest]) -> list[str]:
    """PEFT's ``adapter_names`` for a batch: each request's adapter, or the base model."""
    return [BASE_ADAPTER if r.adapter is None else peft_adapter_name(r.adapter) for r in batch]


def load_peft_model(model_dir: Path, adapter_dirs: Sequence[Path], *, device: str, dtype):
    """The base model holding every adapter (or the bare base model when there is none);
    workload adapter ``k`` is loaded as ``peft_adapter_name(k)``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dirs:
        model = PeftModel.from_pretrained(model, adapter_dirs[0], adapter_name=peft_adapter_name(0))
        for k, path in enumerate(adapter_dirs[1:], start=1):
            model.load_adapter(path, adapter_name=peft_adapter_name(k))
    return model.to(device=device, dtype=dtype).eval()


def run_peft_baseline(
    model_dir: Path,
    adapter_dirs: list[Path],
    requests: Sequence[WorkloadRequest],
    prompts: dict[int, list[int]],
    *,
    batch_size: int,
    device: str = "cpu",
    dtype=torch.float32,
    token_ids: dict[int, list[int]] | None = None,
) -> list[RequestRecord]:
    """Serve ``requests`` with every adapter loaded; ``adapter_dirs[k]`` (a PEFT adapter
    directory) is workload adapter ``k``."""
    model = load_peft_model(model_dir, adapter_dirs, device=device, dtype=dtype)
    return serve_static_batches(
        model,
        requests,
        prompts,
        batch_size=batch_size,
        device=device,
        names_of=adapter_names if adapter_dirs else None,
        token_ids=token_ids,
    )


def serve_static_batches(
    model,
    requests: Sequence[WorkloadRequest],
    prompts: dict[int, list[int]],
    *,
    batch_size: int,
    device: str,
    names_of: Callable[[Sequence[WorkloadRequest]], list[str]] | None,
    before_batch: BatchHook | None = None,
    token_ids: dict[int, list[int]] | None = None,
) -> list[RequestRecord]:
    """The static-batching loop of the module docstring on a loaded ``model``; one record
    per request, in order. ``token_ids``, when given, is filled with each request's
    generated token ids (request index -> ids).

    ``names_of(batch)`` gives PEFT's ``adapter_names`` (None: a model without adapters).
    ``before_batch(batch, next_batch)``, when given, readies a batch's adapters: it is
    called at each batch's start, inside the timed run (its time delays the batch's
    tokens), with the batch after it (empty for the last), and once before the warm-up.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    generate = partial(_generate, model, _pad_id(model.config), device)
    names = names_of or (lambda batch: None)
    ready = before_batch or (lambda batch, next_batch: None)
    if requests:  # first-call costs (allocator, kernels) stay out of the timed run
        warm = [requests[0]]
        ready(warm, [])
        generate([prompts[warm[0].index][:4]], names(warm), 2, None)

    records = new_records(requests, prompts)
    collected = token_ids if token_ids is not None else {}
    order = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        delay = max(r.arrival_s for r in batch) - now()
        if delay > 0:
            time.sleep(delay)
        began = now()
        for r in batch:
            records[r.index].sent_s = began
        clock = _StepClock(now, device)
        new_tokens = max(r.output_len for r in batch)
        try:
            ready(batch, order[start + batch_size : start + 2 * batch_size])
            outputs = generate([prompts[r.index] for r in batch], names(batch), new_tokens, clock)
        except Exception as exc:
            failed = now()
            for r in batch:
                records[r.index].error = f"{type(exc).__name__}: {exc}"
                records[r.index].finish_s = failed
            continue
        for r, tokens in zip(batch, outputs, strict=True):
            record = records[r.index]
            record.token_times_s = list(clock.times[: r.output_len])
            record.finish_s = record.token_times_s[-1] if record.token_times_s else now()
            collected[r.index] = tokens[: r.output_len]
    return [records[r.index] for r in requests]


def _pad_id(config) -> int:
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    return 0 if pad_id is None else int(pad_id)


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [torch.tensor(prompt, dtype=torch.long) for prompt in batch]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side="left")
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
    return ids, mask


class _StepClock:
    """A stopping criterion that never stops: it records when each generation step ends."""

    def __init__(self, now: Callable[[], float], device: str):
        self.now = now
        self.sync = torch.device(device).type == "cuda"
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.sync:
            torch.cuda.synchronize()
        self.times.append(self.now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def _generate(model, pad_id: int, device: str, batch, names, new_tokens: int, clock):
    from transformers import StoppingCriteriaList

    input_ids, attention_mask = _left_pad(batch, pad_id)
    extra = {} if names is None else {"adapter_names": list(names)}
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        stopping_criteria=StoppingCriteriaList([clock]) if clock is not None else None,
        **extra,
    )
    return [row.tolist() for row in out[:, input_ids.shape[1] :].cpu()]


def _adapters_of(batch: Iterable[WorkloadRequest]) -> list[int]:
    """The batch's adapter indices, each once, in request order (base requests skipped)."""
    return list(dict.fromkeys(r.adapter for r in batch if r.adapter is not None))


class AdapterSwapper:
    """The GPU baseline's ``before_batch`` hook: 1,000 adapters of Llama-7B shape (up to
    134 MB each) do not fit in one ``PeftModel``, so it holds at most ``resident``.

    Before each batch, PEFT loads the batch's adapters it does not hold (``add_adapter``
    in the base model's dtype, then ``set_peft_model_state_dict``: the copy to the
    device), delaying the batch's first tokens as a server would. Their host tensors,
    ``make_state(k) -> (LoraConfig, PEFT-named tensors)`` (seconds at 7B shapes, like a
    store fetch), are made on ``workers`` threads one batch ahead, as loramux's loader
    threads work while its steps run; a batch waits for those not ready. To make room,
    the least recently used adapters the batch does not use go first, never the last one
    (PEFT breaks without an adapter).
    ``held``: the adapters the model holds already, least recent first.
    ``before_batch(requests, [])`` outside the timed run preloads (Punica's setting).
    """

    def __init__(
        self,
        model,
        make_state: Callable[[int], tuple[object, dict]],
        *,
        resident: int,
        workers: int,
        held: Sequence[str] = (),
    ):
        if resident < 1 or workers < 1:
            raise ValueError(f"resident and workers must be >= 1, got {resident}, {workers}")
        self.model = model
        self._make_state = make_state
        self._resident = resident
        self._held: OrderedDict[str, None] = OrderedDict.fromkeys(held)  # least recent first
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peft-prefetch")
        self._pending: dict[int, Future] = {}  # adapter index -> its host tensors
        self.stats = {
            "adapter_loads": 0,
            "adapter_evictions": 0,
            "max_adapters_held": len(self._held),
            "wait_for_host_tensors_s": 0.0,  # waiting for host tensors inside batches
            "load_into_peft_s": 0.0,  # add_adapter + copying the tensors in
        }

    def before_batch(
        self, batch: Sequence[WorkloadRequest], next_batch: Sequence[WorkloadRequest]
    ) -> None:
        indices = _adapters_of(batch)
        missing = []
        for k in indices:
            if peft_adapter_name(k) in self._held:
                self._held.move_to_end(peft_adapter_name(k))
            else:
                missing.append(k)
        keep = {peft_adapter_name(k) for k in indices}
        for name in list(self._held):  # least recent first, until the missing ones fit
            if len(self._held) + len(missing) <= self._resident or len(self._held) == 1:
                break
            if name not in keep:
                self.model.delete_adapter(name)
                del self._held[name]
                self.stats["adapter_evictions"] += 1
        for k in missing:
            self._load(k)
        for k in _adapters_of(next_batch):
            if peft_adapter_name(k) not in self._held and k not in self._pending:
                self._pending[k] = self._pool.submit(self._make_state, k)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    def _load(self, k: int) -> None:
        from peft import set_peft_model_state_dict

        name = peft_adapter_name(k)
        started = time.perf_counter()
        future = self._pending.pop(k, None)
        config, state = future.result() if future is not None else self._make_state(k)
        ready = time.perf_counter()
        self.model.add_adapter(name, config, autocast_adapter_dtype=False)
        result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        if result.unexpected_keys:  # a naming mismatch would leave PEFT's own init in place
            raise RuntimeError(f"PEFT ignored tensors of {name}: {result.unexpected_keys[:3]}")
        self._held[name] = None
        self.stats["max_adapters_held"] = max(self.stats["max_adapters_held"], len(self._held))
        self.stats["adapter_loads"] += 1
        self.stats["wait_for_host_tensors_s"] += ready - started
        self.stats["load_into_peft_s"] += time.perf_counter() - ready
