"""Tune the fused LoRA kernels' tiles on this GPU, once, and record them in the repo's table.

The engine never autotunes: its tiles come from ``kernels/lora_tiles.json``
(``loramux.kernels.lora_tiles``), one entry per GPU name. This run measures, at Llama-7B
shapes in bf16 with rank-16 adapters, every candidate of a small grid (``block_k``,
``block_n``, ``target_programs`` in multiples of the SM count, ``num_warps``) for

* the per-token form (``decode``): each token its own adapter;
* the per-segment-tile form (``segments``): every token of one adapter;

over the projection groups of a decode step (q/k/v, gate/up, down; o is q/k/v's shape
with one slice) at 1 and 64 tokens, and keeps for each form the candidate with the least
total time. Then, with the chosen segment tiles, it finds ``fused_max_tokens``: the most
tokens (of 64 to 1,024, one adapter per 64 tokens) for which the fused launch is no
slower than the shrink and expand it replaces. Each candidate's output is checked against
the two-launch path first (a candidate that computes something else is dropped, and said
so).

    python -m loramux.benchmarks.kernels_gpu.tune --out $OUT --write-table
    python -m loramux.benchmarks.kernels_gpu.tune --smoke --out /tmp/x   # CPU plumbing

Writes ``lora_tiles_<gpu>.json`` (every timing, the choice) to ``--out``; with
``--write-table`` also the chosen entry into ``kernels/lora_tiles.json`` of this checkout
(commit it). ``--smoke`` runs two candidates at tiny shapes in Triton's interpreter and
never writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from loramux.benchmarks.common.files import RESULTS_DIR, write_atomic
from loramux.benchmarks.kernels_gpu.lora import grouped_spans, lora_batch
from loramux.benchmarks.kernels_gpu.timing import Timer, relative_error
from loramux.kernels.interpreter import use_cpu_interpreter
from loramux.kernels.lora_batch import LoRABatch
from loramux.kernels.lora_tiles import TILES_FILE, FusedTiles, PhaseTiles, tiles_for

RANK = 16
# (group, in_features, slice widths) at Llama-7B with 8 KV heads; o has q/k/v's input
# width and one slice of q's, so its best tiles are q/k/v's.
GROUPS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}
TOKENS = (1, 64)
FUSED_MAX_CANDIDATES = (64, 128, 256, 512, 1024)
SMOKE_GROUPS = {"qkv": (48, (40, 24, 24)), "down": (64, (40,))}


@dataclasses.dataclass(frozen=True)
class Grid:
    name: str  # what the shapes are, for the table's source line
    groups: dict
    tokens: tuple[int, ...]
    block_k: tuple[int, ...]
    block_n: tuple[int, ...]
    programs_per_sm: tuple[int, ...]
    num_warps: tuple[int, ...]
    fused_max_candidates: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    iters: int = 20
    warmup: int = 3

    def candidates(self, sms: int) -> list[FusedTiles]:
        return [
            FusedTiles(block_k=k, block_n=n, target_programs=p * sms, num_warps=w)
            for k, n, p, w in itertools.product(
                self.block_k, self.block_n, self.programs_per_sm, self.num_warps
            )
        ]


# Each candidate compiles once per shape it splits differently (a second or so each on a
# GPU host): the grid is kept to what one lent machine's call affords.
FULL = Grid(
    "Llama-7B groups, bf16",
    GROUPS,
    TOKENS,
    (128, 256, 512),
    (64, 128),
    (1, 2, 4),
    (4,),
    FUSED_MAX_CANDIDATES,
)
SMOKE = Grid(
    "tiny smoke shapes, float32",
    SMOKE_GROUPS,
    (1, 4),
    (16, 32),
    (16,),
    (1,),
    (4,),
    (8, 16),
    torch.float32,
    iters=1,
    warmup=0,
)


@dataclasses.dataclass
class _Problem:
    x: torch.Tensor
    a_pools: list[torch.Tensor]
    b_pools: list[torch.Tensor]
    outs: list[torch.Tensor]
    batch: LoRABatch


def _problem(group: str, grid: Grid, tokens: int, adapters: int, device) -> _Problem:
    in_features, widths = grid.groups[group]
    spans = grouped_spans(tokens, 1, list(range(adapters)))
    batch = lora_batch([RANK] * adapters, spans, len(widths), tokens, device)

    def rand(*shape, std=1.0):
        return torch.randn(*shape, dtype=grid.dtype, device=device) * std

    return _Problem(
        x=rand(tokens, in_features),
        a_pools=[rand(adapters * RANK, in_features, std=in_features**-0.5) for _ in widths],
        b_pools=[rand(adapters * RANK, n, std=RANK**-0.5) for n in widths],
        outs=[rand(tokens, n) for n in widths],
        batch=batch,
    )


def _two_launches(problem: _Problem, form: str):
    from loramux.kernels import lora_triton

    shrink = getattr(lora_triton, f"lora_shrink_{form}")
    expand = getattr(lora_triton, f"lora_expand_{form}_outs")
    return lambda: expand(
        problem.outs,
        shrink(problem.x, problem.a_pools, problem.batch),
        problem.b_pools,
        problem.batch,
    )


def _fused(problem: _Problem, form: str, tiles: FusedTiles):
    from loramux.kernels import lora_triton_fused

    launch = getattr(lora_triton_fused, f"lora_fused_{form}")
    return lambda: launch(
        problem.x, problem.outs, problem.a_pools, problem.b_pools, problem.batch, tiles
    )


def _checked(problem: _Problem, form: str, tiles: FusedTiles) -> bool:
    """The candidate's result equals the two-launch path's (each from the same outputs)."""
    start = [o.clone() for o in problem.outs]
    results = []
    for launch in (_two_launches(problem, form), _fused(problem, form, tiles)):
        launch()
        results.append(torch.cat(problem.outs, dim=1).float())
        for out, first in zip(problem.outs, start, strict=True):
            out.copy_(first)
    return relative_error(results[1], results[0]) < 1e-2


def tune_form(form: str, grid: Grid, timer: Timer, sms: int, device) -> dict:
    """Every candidate's total time over the groups and token counts; the fastest."""
    adapters_for = (lambda t: t) if form == "bgmv" else (lambda t: 1)
    problems = {
        (group, tokens): _problem(group, grid, tokens, adapters_for(tokens), device)
        for group in grid.groups
        for tokens in grid.tokens
    }
    rows = []
    for tiles in grid.candidates(sms):
        row = {"tiles": dataclasses.asdict(tiles), "ms": {}, "ok": True}
        for (group, tokens), problem in problems.items():
            if not _checked(problem, form, tiles):
                row["ok"] = False
                break
            row["ms"][f"{group}@{tokens}"] = timer.median_s(_fused(problem, form, tiles)) * 1e3
        row["total_ms"] = sum(row["ms"].values()) if row["ok"] else None
        rows.append(row)
        print(f"{form} {tiles}: {row['total_ms']}", flush=True)
    usable = [r for r in rows if r["ok"]]
    if not usable:
        raise RuntimeError(f"no {form} candidate matched the two-launch path")
    best = min(usable, key=lambda r: r["total_ms"])
    base = {
        f"{group}@{tokens}": timer.median_s(_two_launches(problem, form)) * 1e3
        for (group, tokens), problem in problems.items()
    }
    return {"rows": rows, "best": best, "two_launch_ms": base}


def tune_fused_max_tokens(grid: Grid, tiles: FusedTiles, timer: Timer, device) -> dict:
    """The most tokens for which the segment form is no slower than two launches (q/k/v
    and gate/up, one adapter per 64 tokens)."""
    rows, largest = [], grid.fused_max_candidates[0]
    for tokens in grid.fused_max_candidates:
        adapters = max(1, tokens // 64)
        fused_ms = two_ms = 0.0
        for group in ("qkv", "gate_up") if "gate_up" in grid.groups else tuple(grid.groups):
            problem = _problem(group, grid, tokens, adapters, device)
            fused_ms += timer.median_s(_fused(problem, "sgmv", tiles)) * 1e3
            two_ms += timer.median_s(_two_launches(problem, "sgmv")) * 1e3
        rows.append({"tokens": tokens, "fused_ms": fused_ms, "two_launch_ms": two_ms})
        if fused_ms <= two_ms:
            largest = tokens
    return {"rows": rows, "fused_max_tokens": largest}


def write_table(name: str, entry: PhaseTiles, table_path: Path) -> None:
    table = json.loads(table_path.read_text())
    table[name] = entry.to_json()
    write_atomic(table_path, json.dumps(table, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--write-table", action="store_true", help=f"update kernels/{TILES_FILE}")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("kernels_gpu_tune: no CUDA device; run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    if args.smoke:
        use_cpu_interpreter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    grid = SMOKE if args.smoke else FULL
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    timer = Timer(device, iters=grid.iters, warmup=grid.warmup)
    began = time.perf_counter()
    decode = tune_form("bgmv", grid, timer, sms, device)
    segments = tune_form("sgmv", grid, timer, sms, device)
    chosen_segments = FusedTiles(**segments["best"]["tiles"])
    fused_max = tune_fused_max_tokens(grid, chosen_segments, timer, device)
    date = time.strftime("%Y-%m-%d")
    entry = PhaseTiles(
        decode=FusedTiles(**decode["best"]["tiles"]),
        segments=chosen_segments,
        fused_max_tokens=fused_max["fused_max_tokens"],
        prefill_block_m=tiles_for(None).prefill_block_m,
        source=f"tuned on {gpu} on {date} by kernels_gpu_tune ({len(grid.candidates(sms))} "
        f"candidates per form, rank {RANK}, {grid.name} at {grid.tokens} tokens)",
    )
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    result = {
        "benchmark": "kernels_gpu_tune",
        "device": gpu,
        "seconds": round(time.perf_counter() - began, 1),
        "chosen": entry.to_json(),
        "decode": decode,
        "segments": segments,
        "fused_max_tokens": fused_max,
    }
    path = args.out / f"lora_tiles_{slug}{'-smoke' if args.smoke else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result, indent=2) + "\n")
    print(f"chosen: {json.dumps(entry.to_json())}\nwrote {path}")
    if args.write_table and not args.smoke:
        table_path = Path(str(resources.files("loramux.kernels").joinpath(TILES_FILE)))
        write_table(gpu, entry, table_path)
        print(f"wrote the {gpu} entry into {table_path}: commit it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
