"""S-LoRA's synthetic workloads as S-LoRA's own scripts make them (S-LoRA/S-LoRA,
``benchmarks/trace.py`` ``generate_requests``, ``exp_suite.py`` and ``run_exp.py``).

* One legacy NumPy stream seeded with 42 (``np.random.seed``), drawn in S-LoRA's order,
  each for all requests at once: adapter popularity ``power(alpha)`` (alpha 1: uniform),
  index ``int(x * num_adapters)``; prompt lengths, then output lengths, ``randint(lo, hi)``
  (``hi`` excluded); inter-arrival gaps ``gamma(1 / cv², cv² / rate)``, request ``i``
  arriving at the sum of the first ``i + 1``.
* ``rate * duration`` requests (S-LoRA's main table: 10 req/s for 120 s, cv 1, alpha 1,
  lengths in [8, 512), at 2, 5, 100, 1,000 and 2,000 adapters; S4 at 6 req/s).
* Adapter ``k`` has rank ``ranks[k % len(ranks)]`` (``get_adapter_dirs``' round robin), on
  q/k/v/o. S1: Llama-7B, rank 8; S2: Llama-7B, ranks 64/32/16/8; S4: Llama-13B, ranks
  64/32/16.
* Throughput is S-LoRA's: finished requests over the time from the first arrival's start
  to the last finish.

S-LoRA sends "Hello " repeated ``prompt_len`` times; here a request's prompt is
``prompt_len`` token ids drawn per request (``workload.prompt_token_ids``), so no two
prompts share a prefix the cache could reuse, as S-LoRA's repeated word would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loramux.benchmarks.common.workload import WorkloadRequest
from loramux.benchmarks.serve.gpu_model import LLAMA_7B

LLAMA_13B = {
    **LLAMA_7B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
TABLE_ADAPTERS = (2, 5, 100, 1000, 2000)  # exp_suite.py "a100-80-table"
SEED = 42


@dataclass(frozen=True)
class SLoRASetting:
    name: str
    model: dict  # HF config.json
    ranks: tuple[int, ...]
    rate: float  # the main table's offered requests per second
    duration_s: float = 120.0
    input_range: tuple[int, int] = (8, 512)  # randint's: hi excluded
    output_range: tuple[int, int] = (8, 512)
    alpha: float = 1.0
    cv: float = 1.0


SETTINGS = {
    "S1": SLoRASetting("S1", LLAMA_7B, (8,), rate=10.0),
    "S2": SLoRASetting("S2", LLAMA_7B, (64, 32, 16, 8), rate=10.0),
    "S4": SLoRASetting("S4", LLAMA_13B, (64, 32, 16), rate=6.0, duration_s=300.0),
}


def slora_requests(
    setting: SLoRASetting,
    num_adapters: int,
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    seed: int = SEED,
) -> list[WorkloadRequest]:
    """S-LoRA's trace for ``setting`` at ``num_adapters`` (its rate and duration unless
    given), as ``generate_requests`` draws it."""
    rate = setting.rate if rate is None else rate
    duration_s = setting.duration_s if duration_s is None else duration_s
    total = int(rate * duration_s)
    draws = np.random.RandomState(seed)  # what np.random.seed(seed) seeds
    adapters = (draws.power(setting.alpha, total) * num_adapters).astype(int)
    input_lens = draws.randint(setting.input_range[0], setting.input_range[1], total)
    output_lens = draws.randint(setting.output_range[0], setting.output_range[1], total)
    cv = setting.cv
    gaps = draws.gamma(1 / (cv * cv), cv * cv / rate, total)
    arrivals = np.cumsum(gaps)
    return [
        WorkloadRequest(
            index=i,
            arrival_s=float(arrivals[i]),
            adapter=int(adapters[i]),
            prompt_len=int(input_lens[i]),
            output_len=int(output_lens[i]),
            tenant="default",
        )
        for i in range(total)
    ]


def adapter_rank(setting: SLoRASetting, index: int) -> int:
    return setting.ranks[index % len(setting.ranks)]
