"""``loramux bench tensor-parallel`` (``python -m loramux.benchmarks.tensor_parallel``): what
splitting one engine over two processes costs in communication, next to one process with as
many cores.

The same requests (``--requests`` greedy requests of ``--tokens`` tokens over a mix of
adapters: ranks 8 and 16, attention-only and all seven modules) run on two engines in turn:
one process with ``--cores`` torch threads (``tensor_parallel_size=1``), and two ranks of
``--cores / 2`` threads each (gloo between them on the CPU; NCCL on GPUs with ``--device
cuda``). The default model is SmolLM2-135M's shape with 8 query heads of 72 instead of its 9
(which do not split over 2 ranks) and random weights: a step's work and bytes do not depend
on the weights' values. ``--model`` serves a real checkpoint instead.

Per engine: output tokens/s and the mean step time after a warm-up; for the split one, the
share of the steps' time rank 0 spent in collectives (the two all-reduces per layer, the
embedding's and the LM head's gathers; each includes waiting for the slower rank) and sending
commands. Both engines' token ids are compared: a difference makes the command exit with 1
(tensor parallelism must not change what is served).

On a 2-core CPU the split cannot be faster (both layouts share the same two cores, and the
split adds its collectives and rank 0's commands); the figure that carries over to GPUs is
the communication share (on NVLink a smaller share of much faster steps; unmeasured there
until a machine with two GPUs runs ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, prepare_adapters
from loramux.benchmarks.common.files import add_output_options, publish_folder
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import Markdown, num, pct, write

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about a lighthouse.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why not Sydney?",
]
SHAPES = ((8, QKVO), (16, ALL_SEVEN))


def all_reduce_ms(
    hidden: int, tokens: int, device: str, rank: int = 0, port: int = 0, count: int = 200
) -> float:
    """Milliseconds of one all-reduce of a step's ``[tokens, hidden]`` activations between
    two ranks doing nothing else (``count`` back to back): the collectives' own cost, apart
    from waiting for a busier rank. Rank 0 starts rank 1 as a process."""
    from loramux.engine.parallel.group import GroupAddress, TensorParallelGroup, free_port

    torch.set_num_threads(1)
    port = port or free_port()
    peer = None
    if rank == 0:
        call = f"all_reduce_ms({hidden}, {tokens}, {device!r}, 1, {port}, {count})"
        code = f"from {__name__} import all_reduce_ms; {call}"
        peer = subprocess.Popen([sys.executable, "-c", code])
    target = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    group = TensorParallelGroup(GroupAddress("127.0.0.1", port, 2), rank, target)
    activations = torch.zeros(tokens, hidden, device=target)
    for repeats in (10, count):  # a warm-up, then the timed ones
        started = time.perf_counter()
        for _ in range(repeats):
            group.all_reduce_(activations)
        if target.type == "cuda":
            torch.cuda.synchronize(target)
    elapsed = time.perf_counter() - started
    if peer is not None:
        peer.wait(60)
    return 1000 * elapsed / count


def eight_head_model(cache_dir: Path) -> Path:
    """SmolLM2-135M's config with 8 query heads of 72 (4 KV heads), and its tokenizer: a
    folder for random weights."""
    source = prepare_model(cache_dir)
    target = cache_dir / "SmolLM2-135M-8-heads"
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "config.json" and not path.name.endswith(".safetensors"):
            shutil.copy2(path, staging / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=72)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    publish_folder(staging, target, (target / "config.json").is_file)
    return target


def run_engine(args, model_dir: Path, adapters, world: int) -> dict:
    from loramux.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=256 << 20,
            load_format=args.load_format,
            enable_prefix_caching=False,
            tensor_parallel_size=world,
            compute_threads=args.cores,  # each rank gets its part
        )
    )
    try:
        for spec in adapters:
            engine.add_adapter(spec.name, spec.path)
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        chosen = [adapters[i % len(adapters)].name for i in range(args.requests)]
        engine.generate(prompts[:2], SamplingParams(max_tokens=2), adapters=chosen[:2])  # warm
        steps, step = [], engine.step

        def timed_step():
            began = time.perf_counter()
            outputs = step()
            steps.append(time.perf_counter() - began)
            return outputs

        engine.step = timed_step
        group = engine.devices.group  # None on one device
        comm_before = (0.0, 0.0) if group is None else (group.collective_s, group.command_s)
        started = time.perf_counter()
        outs = engine.generate(prompts, params, adapters=chosen)
        wall = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        step_s = sum(steps)
        result = {
            "tensor_parallel_size": world,
            "threads_per_process": max(1, args.cores // world),
            "wall_s": wall,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "steps": len(steps),
            "step_ms_mean": 1000 * step_s / len(steps),
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


def markdown(report: dict) -> Markdown:
    one, split = report["one_process"], report["tensor_parallel"]
    md = Markdown("Tensor parallelism: communication share of a step")
    md.text(
        f"{report['requests']} greedy requests of {report['tokens']} tokens over "
        f"{report['adapters']} adapters, {report['device']}, model {report['model']}; same "
        "requests on both engines."
    )

    def row(label: str, engine: dict, *shares: str) -> tuple:
        layout = f"{engine['tensor_parallel_size']} x {engine['threads_per_process']}"
        speed = (num(engine["output_tokens_per_s"]), num(engine["step_ms_mean"]))
        return (label, layout, *speed, *shares)

    comm, command = pct(split["communication_share"], 1), pct(split["command_share"], 1)
    columns = ("engine", "processes x threads", "output tok/s", "mean step ms")
    md.table(
        (*columns, "in collectives", "sending commands"),
        [
            row("one process", one, "-", "-"),
            row("tensor parallel", split, f"{comm} of step time", command),
        ],
        "llrrrr",
    )
    md.text(
        f"Same tokens on both: **{report['same_tokens']}**. Tensor parallel / one process: "
        f"{report['throughput_ratio']:.2f}x output tokens/s.",
        f"The collectives' own cost: one all-reduce of a decode step's "
        f"[{report['requests']}, hidden] activations between two ranks doing nothing else "
        f"takes {split['all_reduce_ms']:.3f} ms, so a decode step's "
        f"{2 * report['layers'] + 1} all-reduces {split['step_all_reduces_ms']:.1f} ms "
        f"({pct(split['step_all_reduces_ms'] / split['step_ms_mean'])} of the mean step); "
        "the rest of the time in collectives is a rank waiting for the other, which also "
        "takes the command from rank 0 and has its share of the step's work to do.",
    )
    return md.machine(report["machine"])


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, help="HF folder (default: SmolLM2's shape with 8 heads, random)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (needs 2 GPUs)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bf16 on CUDA")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--cores", type=int, default=2, help="threads of the one process")
    parser.add_argument("--smoke", action="store_true", help="2 requests of 4 tokens")
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and torch.cuda.device_count() < 2:
        print(
            f"--device cuda needs two GPUs (one per rank); this machine has "
            f"{torch.cuda.device_count()}, so the GPU figures are not measured yet",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        args.requests, args.tokens = 2, 4
    args.load_format = "safetensors" if args.model else "random"
    model_dir = args.model or eight_head_model(args.cache_dir)
    adapters = prepare_adapters(args.cache_dir, model_dir, SHAPES, 4, seed=0)
    one = run_engine(args, model_dir, adapters, 1)
    split = run_engine(args, model_dir, adapters, 2)
    same = one.pop("token_ids") == split.pop("token_ids")
    model_config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = model_config["hidden_size"], model_config["num_hidden_layers"]
    probes = 20 if args.smoke else 200
    split["all_reduce_ms"] = all_reduce_ms(hidden, args.requests, args.device, count=probes)
    # A decode step of the run: two all-reduces per layer and the embedding's, back to back.
    split["step_all_reduces_ms"] = split["all_reduce_ms"] * (2 * layers + 1)
    report = {
        "requests": args.requests,
        "tokens": args.tokens,
        "adapters": len(adapters),
        "device": args.device,
        "model": f"{model_dir.name} ({args.load_format} weights)",
        "layers": layers,
        "one_process": one,
        "tensor_parallel": split,
        "same_tokens": same,
        "throughput_ratio": split["output_tokens_per_s"] / one["output_tokens_per_s"],
        "machine": machine_info(args.device),
    }
    write(args.out / f"tensor_parallel_{args.device.split(':')[0]}", report, markdown(report))
    return 0 if same else 1
