"""``python -m loramux.benchmarks.tensor_parallel``: what splitting one engine over two
processes costs in communication, next to one process with as many cores.

The same requests (SmolLM2-135M-Instruct in float32 by default, ``--requests`` greedy
requests of ``--tokens`` tokens over a mix of adapters: ranks 8 and 16, attention-only and
all seven modules) run on two engines in turn:

* **one process**: ``tensor_parallel_size=1`` with ``--cores`` torch threads;
* **tensor parallel**: ``tensor_parallel_size=2``, each rank one process with
  ``--cores / 2`` threads (gloo between them on the CPU; NCCL on GPUs with ``--device cuda``).

Per engine: wall seconds, output tokens/s and the mean step time (``engine.step`` timed,
after a warm-up); for the tensor-parallel one, the seconds rank 0 spent in collectives
(the two all-reduces per layer, the embedding's and the LM head's gathers; each includes
waiting for the slower rank) and their share of the steps' time: the communication share
of a step. Both engines' token ids are compared: a difference is reported and makes the
command exit with 1 (tensor parallelism must not change what is served).

On a 2-core CPU the split cannot be faster: both layouts use the same two cores, and the
split adds its collectives and the per-step command from rank 0. The figure that carries
over to GPUs is the communication share (on NVLink it is a smaller share of much faster
steps; on a GPU pair the same script measures it: ``--device cuda``, unmeasured until a
machine with two GPUs runs it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from loramux.benchmarks.adapters import ALL_SEVEN, QKVO, prepare_adapters
from loramux.benchmarks.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.machine import machine_info, machine_text
from loramux.benchmarks.models import prepare_model

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about a lighthouse.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why not Sydney?",
]
SHAPES = ((8, QKVO), (16, ALL_SEVEN))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loramux.benchmarks.tensor_parallel")
    parser.add_argument("--model", type=Path, help="HF folder (default: SmolLM2 from the GGUF)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (needs 2 GPUs)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bf16 on CUDA")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--cores", type=int, default=2, help="threads of the one process")
    parser.add_argument("--smoke", action="store_true", help="2 requests of 4 tokens")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    if args.smoke:
        args.requests, args.tokens = 2, 4
    return args


class StepTimer:
    """Wraps ``engine.step``: the seconds of every step after ``reset``."""

    def __init__(self, engine):
        self.seconds: list[float] = []
        step = engine.step

        def timed():
            started = time.perf_counter()
            out = step()
            self.seconds.append(time.perf_counter() - started)
            return out

        engine.step = timed


def run_engine(args, model_dir: Path, adapters, world: int) -> dict:
    from loramux.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(max(1, args.cores // world))  # rank 0's; the others get theirs
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=256 << 20,
            enable_prefix_caching=False,
            tensor_parallel_size=world,
        )
    )
    try:
        names = []
        for spec in adapters:
            engine.add_adapter(spec.name, spec.path)
            names.append(spec.name)
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        chosen = [names[i % len(names)] for i in range(args.requests)]
        engine.generate(prompts[:2], SamplingParams(max_tokens=2), adapters=chosen[:2])  # warm
        timer = StepTimer(engine)
        group = None if engine.ranks is None else engine.ranks.group
        comm_before = (0.0, 0.0) if group is None else (group.collective_s, group.command_s)
        started = time.perf_counter()
        outs = engine.generate(prompts, params, adapters=chosen)
        wall = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        step_s = sum(timer.seconds)
        result = {
            "tensor_parallel_size": world,
            "threads_per_process": max(1, args.cores // world),
            "wall_s": wall,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "steps": len(timer.seconds),
            "step_ms_mean": 1000 * step_s / len(timer.seconds),
            "token_ids": [o.token_ids for o in outs],
        }
        if group is not None:
            result["collective_s"] = group.collective_s - comm_before[0]
            result["command_s"] = group.command_s - comm_before[1]
            result["communication_share"] = result["collective_s"] / step_s
            result["command_share"] = result["command_s"] / step_s
        return result
    finally:
        engine.close()


def markdown(report: dict) -> str:
    one, split = report["one_process"], report["tensor_parallel"]
    lines = [
        "# Tensor parallelism: communication share of a step",
        "",
        f"{report['requests']} greedy requests of {report['tokens']} tokens over "
        f"{report['adapters']} adapters, {report['device']}; same requests on both engines.",
        "",
        "| engine | processes x threads | output tok/s | mean step ms | in collectives "
        "| sending commands |",
        "|---|---|---:|---:|---:|---:|",
        f"| one process | 1 x {one['threads_per_process']} | {one['output_tokens_per_s']:.1f} "
        f"| {one['step_ms_mean']:.1f} | - | - |",
        f"| tensor parallel | 2 x {split['threads_per_process']} "
        f"| {split['output_tokens_per_s']:.1f} | {split['step_ms_mean']:.1f} "
        f"| {100 * split['communication_share']:.1f}% of step time "
        f"| {100 * split['command_share']:.1f}% |",
        "",
        f"Same tokens on both: **{report['same_tokens']}**. Tensor parallel / one process: "
        f"{report['throughput_ratio']:.2f}x output tokens/s.",
        "",
        machine_text(report["machine"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model_dir = args.model or prepare_model(args.cache_dir)
    adapters = prepare_adapters(args.cache_dir, model_dir, SHAPES, 4, seed=0)
    one = run_engine(args, model_dir, adapters, 1)
    split = run_engine(args, model_dir, adapters, 2)
    same = one.pop("token_ids") == split.pop("token_ids")
    report = {
        "requests": args.requests,
        "tokens": args.tokens,
        "adapters": len(adapters),
        "device": args.device,
        "one_process": one,
        "tensor_parallel": split,
        "same_tokens": same,
        "throughput_ratio": split["output_tokens_per_s"] / one["output_tokens_per_s"],
        "machine": machine_info(args.device),
    }
    stem = args.out / f"tensor_parallel_{args.device.split(':')[0]}"
    write_report(stem, report, markdown(report))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
