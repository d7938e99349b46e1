"""Serve a workload with transformers + PEFT: the static-batching baseline.

One ``PeftModel`` holds every adapter (``load_peft_model``) and a batch mixes adapters
with PEFT's ``generate(..., adapter_names=[...])``; a base-model request uses PEFT's
``"__base__"``. Prompts are left-padded, with an attention mask over the padding.
``serve_static_batches`` is the loop itself, on a model built elsewhere, with an optional
hook that readies each batch's adapters before it runs (``driver_peft_swap``: the GPU
baseline, which cannot hold every adapter at once).

Rules:

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
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from loramux.benchmarks.measures import RequestRecord, new_records
from loramux.benchmarks.workload import WorkloadRequest

BASE_ADAPTER = "__base__"  # PEFT's adapter_names entry for "no adapter"


def peft_adapter_name(k: int) -> str:
    """The name workload adapter ``k`` is loaded under in the PeftModel."""
    return f"a{k}"


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


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
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
def _generate(model, batch, names, pad_id: int, new_tokens: int, clock, device: str):
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
    """Serve ``requests`` with transformers + PEFT; one record per request, in order.

    ``adapter_dirs[k]`` is workload adapter ``k`` (a PEFT adapter directory). ``token_ids``,
    when given, is filled with each request's generated token ids (request index -> ids).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
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


def adapter_names(batch: Sequence[WorkloadRequest]) -> list[str]:
    """PEFT's ``adapter_names`` for a batch: each request's adapter, or the base model."""
    return [BASE_ADAPTER if r.adapter is None else peft_adapter_name(r.adapter) for r in batch]


def _pad_id(config) -> int:
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    return 0 if pad_id is None else int(pad_id)


BatchHook = Callable[[Sequence[WorkloadRequest], Sequence[WorkloadRequest]], None]


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
    """The static-batching loop of the module docstring on a loaded ``model``.

    ``names_of(batch)`` gives PEFT's ``adapter_names`` (None: a model without adapters).
    ``before_batch(batch, next_batch)``, when given, readies a batch's adapters: it is
    called at each batch's start, inside the timed run (its time delays the batch's
    tokens), with the batch after it (empty for the last), and once before the warm-up.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pad_id = _pad_id(model.config)

    def names(batch: Sequence[WorkloadRequest]) -> list[str] | None:
        return None if names_of is None else names_of(batch)

    warm = [requests[0]] if requests else []
    if warm:  # first-call costs (allocator, kernels) stay out of the timed run
        if before_batch is not None:
            before_batch(warm, [])
        _generate(model, [prompts[warm[0].index][:4]], names(warm), pad_id, 2, None, device)

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
            if before_batch is not None:
                before_batch(batch, order[start + batch_size : start + 2 * batch_size])
            outputs = _generate(
                model,
                [prompts[r.index] for r in batch],
                names(batch),
                pad_id,
                new_tokens,
                clock,
                device,
            )
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
