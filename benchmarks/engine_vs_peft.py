"""The engine against transformers + PEFT mixed-adapter ``generate``, on the same prompts.

The issue's CPU benchmark: SmolLM2-135M-Instruct, 32 concurrent requests over 16 LoRA
adapters (request i uses adapter i % 16), 128 new tokens each, greedy. Both systems run
in the same process, one after the other, on the same chat-templated prompt token ids:

* engine: ``Engine.generate`` of all requests at once (continuous batching, every
  adapter in the same forward pass);
* baseline: one ``PeftModel`` holding all adapters, ``model.generate(...,
  adapter_names=[...])`` (PEFT's mixed-adapter batching) with left padding, as one batch
  of all requests and in batches of 8; the faster is the baseline.

Output length is fixed on both sides the same way: EOS is suppressed until the last
token (``min_tokens = max_tokens`` on the engine, ``min_new_tokens = max_new_tokens`` on
PEFT), so every request generates exactly ``--max-tokens`` tokens and a greedy token
sequence means the same thing on both sides.

Reports tokens, wall seconds and tokens/s of each, the ratio engine / PEFT, and greedy
agreement (requests whose tokens are identical; left padding can legitimately flip a
near-tie argmax in PEFT's batches, so it is reported, not asserted). Writes a JSON and a
markdown table with the machine to ``benchmarks/results/``.

    .venv/bin/python benchmarks/engine_vs_peft.py            # full size (several minutes)
    .venv/bin/python benchmarks/engine_vs_peft.py --quick    # smoke run
    .venv/bin/python benchmarks/engine_vs_peft.py --profile  # plus a cProfile of the engine
    .venv/bin/python benchmarks/engine_vs_peft.py --repeats 3 --profile  # the recorded run

The machine is shared: each timed part records the cores this process actually got
(CPU seconds / wall seconds) and the load average, and ``--repeats`` interleaves runs
and reports the best of each, so one run slowed by a neighbour does not decide it.

``--before REV`` also measures the engine of git revision REV in the same run, on the
same prompts and adapters, interleaved with this checkout's engine: REV is checked out
into a temporary ``git worktree`` (removed afterwards, also on errors), and each engine
run, before and after alike, is a worker process (``engine_vs_peft_worker.py``) whose
``PYTHONPATH`` puts a ``loramux/`` first that links that tree's package folders as
pyproject's ``package-dir`` maps them (the worker checks where ``loramux.engine`` came
from); the two engines' order alternates from one repeat to the next. The report adds
the before engine's row, the after / before tokens/s ratio, and whether their greedy
tokens agree; "after" is this working tree, uncommitted changes included (the report
says whether ``engine/`` or ``kernels/`` had any).

    .venv/bin/python benchmarks/engine_vs_peft.py --repeats 3 --before HEAD~3
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import gc
import io
import json
import os
import platform
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
WORKER = Path(__file__).resolve().parent / "engine_vs_peft_worker.py"
MODEL_NAME = "SmolLM2-135M-Instruct"
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_SEVEN = (*QKVO, "gate_proj", "up_proj", "down_proj")
# Adapter i gets ADAPTER_SHAPES[i % 4]: mixed ranks and target sets.
ADAPTER_SHAPES = ((8, QKVO), (16, QKVO), (8, ALL_SEVEN), (16, ALL_SEVEN))
ADAPTER_STD = 0.02  # init std of A and B: a visible but not model-destroying change

QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "How do I boil an egg?",
    "What causes the seasons on Earth?",
    "Suggest a name for a grey cat.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is a prime number?",
    "How can I learn to play the guitar?",
    "Translate 'good morning' into Spanish.",
    "What are the benefits of drinking water?",
    "Describe a rainy day in two sentences.",
    "How does a bicycle stay upright?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "What should I pack for a weekend hike?",
    "Explain what a computer program is.",
    "Why do leaves change colour in the fall?",
    "Tell me a fun fact about octopuses.",
    "How do I make my houseplants grow better?",
    "What is the tallest mountain in the world?",
    "Write a two-line poem about the sea.",
    "How do vaccines work?",
    "What is the Pythagorean theorem?",
    "Give me an idea for a birthday party.",
    "Why do we need sleep?",
    "What is the best way to save money?",
    "Describe the taste of a lemon.",
)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    rank: int
    targets: tuple[str, ...]


class Clock:
    """Wall seconds of a block, and how much CPU this process got meanwhile.

    The CPU seconds over the wall seconds, against the torch thread count, shows whether
    other processes competed for the cores during the measurement.
    """

    def __enter__(self) -> Clock:
        self.load_before = os.getloadavg()[0]
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.process_time() - self._cpu
        self.load_after = os.getloadavg()[0]

    def summary(self) -> dict:
        return {
            "cpu_seconds": round(self.cpu_seconds, 2),
            "cores_used": round(self.cpu_seconds / self.seconds, 2),
            "loadavg_1m_before": round(self.load_before, 2),
            "loadavg_1m_after": round(self.load_after, 2),
        }

    def to_json(self) -> dict:
        """Every reading, unrounded (a worker process hands its clock back so)."""
        names = ("seconds", "cpu_seconds", "load_before", "load_after")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_json(cls, raw: dict) -> Clock:
        clock = cls()
        for name, value in raw.items():
            setattr(clock, name, float(value))
        return clock


@dataclass
class RunResult:
    label: str
    tokens: list[list[int]]  # per request, in request order
    clock: Clock
    batch: str  # how the requests were batched
    extra: dict = field(default_factory=dict)  # system-specific figures

    @property
    def seconds(self) -> float:
        return self.clock.seconds

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    def summary(self) -> dict:
        return {
            "label": self.label,
            "batch": self.batch,
            "requests": len(self.tokens),
            "tokens": self.num_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            **self.clock.summary(),
            **self.extra,
        }


# --- setup ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="default 32 (8 with --quick)")
    parser.add_argument("--adapters", type=int, default=None, help="default 16 (4 with --quick)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128 (16 --quick)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument(
        "--peft-batch-sizes",
        default=None,
        help="comma-separated PEFT batch sizes to time; the fastest is the baseline "
        "(default: all requests in one batch, and 8)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result path; the markdown goes next to it "
        "(default benchmarks/results/engine_vs_peft_cpu[_quick].json)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO_ROOT / ".loramux" / "bench-cache",
        help="where the converted model and the adapters are cached",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved runs of each system; the best is reported (all are recorded)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed runs, run the engine once more under cProfile and write "
        "the top functions next to the JSON",
    )
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also measure the engine of git revision REV (from a temporary worktree) in "
        "the same run, interleaved with this checkout's; both then run in worker processes",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.requests = args.requests or (8 if quick else 32)
    args.adapters = args.adapters or (4 if quick else 16)
    args.max_tokens = args.max_tokens or (16 if quick else 128)
    if args.peft_batch_sizes is None:
        sizes = [args.requests] + ([8] if args.requests > 8 else [])
    else:
        sizes = [int(s) for s in args.peft_batch_sizes.split(",") if s.strip()]
    if not sizes or any(s < 1 for s in sizes):
        parser.error("--peft-batch-sizes needs positive integers")
    args.peft_batch_sizes = sizes
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats and --threads must be positive")
    if args.out is None:
        stem = "engine_vs_peft_cpu_quick" if quick else "engine_vs_peft_cpu"
        args.out = RESULTS_DIR / f"{stem}.json"
    if min(args.requests, args.adapters, args.max_tokens) < 1:
        parser.error("--requests, --adapters and --max-tokens must be positive")
    if args.before is not None:
        try:
            resolve_commit(args.before)
        except RuntimeError as exc:
            parser.error(str(exc))
    return args


def machine_info() -> dict:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    import peft
    import transformers

    uname = platform.uname()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model,
        "uname": f"{uname.system} {uname.release} {uname.machine}",
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "mem_total_gib": mem_gib,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def prepare_model(cache_dir: Path) -> Path:
    from loramux.engine.model.gguf_convert import convert_gguf_to_hf
    from loramux.platform.base_model import embedded_gguf_path

    return convert_gguf_to_hf(embedded_gguf_path(), cache_dir / MODEL_NAME, log=print)


def prepare_adapters(
    model_dir: Path, cache_dir: Path, count: int, shapes=ADAPTER_SHAPES
) -> list[AdapterSpec]:
    """``count`` PEFT adapters of mixed ranks and targets, built once and cached: adapter i
    gets ``shapes[i % len(shapes)]`` (rank, target modules)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.models import build_peft_adapter

    specs = []
    for i in range(count):
        rank, targets = shapes[i % len(shapes)]
        tag = "qkvo" if targets == QKVO else "all7"
        path = cache_dir / "adapters" / f"a{i:02d}-r{rank}-{tag}-std{ADAPTER_STD}-seed{1000 + i}"
        if not (path / "adapter_model.safetensors").is_file():
            print(f"building adapter {path.name} ...", flush=True)
            tmp = path.with_name(path.name + ".partial")
            build_peft_adapter(
                model_dir, tmp, rank=rank, targets=targets, seed=1000 + i, std=ADAPTER_STD
            )
            tmp.rename(path)
        specs.append(AdapterSpec(f"a{i:02d}", path, rank, targets))
    return specs


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` different chat-templated prompts as token ids (shared by both systems)."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"{question} (Answer #{i // len(QUESTIONS) + 1}.)"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


# --- the engine ----------------------------------------------------------------------
def build_engine(model_dir: Path, adapters: list[AdapterSpec], max_num_seqs: int):
    from loramux.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_bytes=512 * 1024**2,
            max_num_seqs=max(64, max_num_seqs),
            max_num_batched_tokens=2048,
            device="cpu",
            dtype="float32",
        )
    )
    for spec in adapters:
        engine.add_adapter(spec.name, spec.path)
    return engine


def engine_params(max_tokens: int):
    from loramux.engine import SamplingParams

    # min_tokens = max_tokens suppresses EOS until the end, exactly like PEFT's
    # min_new_tokens = max_new_tokens: fixed length, same greedy choice at every step.
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)


def warm_up(engine, adapter_names) -> None:
    """A tiny mixed-adapter generate on unrelated prompts (so the timed run gets no
    prefix-cache hits from it)."""
    from loramux.engine import SamplingParams

    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(["Hello there", "Warm up"], warm, adapters=(adapter_names * 2)[:2])


def run_engine(engine, prompts, adapter_names, max_tokens: int) -> RunResult:
    warm_up(engine, adapter_names)
    params = engine_params(max_tokens)
    with Clock() as clock:
        outs = engine.generate(prompts, params, adapters=adapter_names)
    result = RunResult("engine", [list(o.token_ids) for o in outs], clock, "all at once")
    ttfts = sorted(
        o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None
    )
    result.extra = {
        "ttft_median_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
        "cached_prompt_tokens": sum(o.metrics.cached_prompt_tokens for o in outs),
        "preemptions": engine.num_preemptions,
    }
    return result


def profile_engine(engine, prompts, adapter_names, max_tokens: int, out_txt: Path) -> None:
    # The prompts differ from the timed run's by one leading token so the prefix cache
    # holds nothing for them; the cost profile is that of the timed run.
    bos = prompts[0][0]
    fresh = [[bos, *p] for p in prompts]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    engine.generate(fresh, engine_params(max_tokens), adapters=adapter_names)
    profiler.disable()
    seconds = time.perf_counter() - start
    buf = io.StringIO()
    buf.write(f"engine.generate under cProfile: {seconds:.2f} s (profiling overhead included)\n\n")
    stats = pstats.Stats(profiler, stream=buf).strip_dirs()
    buf.write("=== by total time (self) ===\n")
    stats.sort_stats("tottime").print_stats(30)
    buf.write("=== by cumulative time ===\n")
    stats.sort_stats("cumulative").print_stats(40)
    out_txt.parent.mkdir(parents=True, exist_ok=True)
    out_txt.write_text(buf.getvalue())


# --- transformers + PEFT -------------------------------------------------------------
def build_peft(model_dir: Path, adapters: list[AdapterSpec]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[0].path, adapter_name=adapters[0].name)
    for spec in adapters[1:]:
        model.load_adapter(spec.path, adapter_name=spec.name)
    model.eval()
    return model


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def peft_generate(model, batch, names, pad_id: int, max_tokens: int) -> list[list[int]]:
    input_ids, attention_mask = _left_pad(batch, pad_id)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        adapter_names=list(names),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return [row.tolist() for row in out[:, input_ids.shape[1] :]]


def run_peft(model, prompts, adapter_names, pad_id: int, max_tokens: int, batch_size: int):
    warm_names = (adapter_names * 2)[:2]
    peft_generate(model, [[1, 2, 3, 4], [5, 6]], warm_names, pad_id, 2)  # warm-up
    tokens: list[list[int]] = []
    with Clock() as clock:
        for i in range(0, len(prompts), batch_size):
            tokens += peft_generate(
                model,
                prompts[i : i + batch_size],
                adapter_names[i : i + batch_size],
                pad_id,
                max_tokens,
            )
    batches = -(-len(prompts) // batch_size)
    label = f"PEFT batch {batch_size}"
    return RunResult(label, tokens, clock, f"{batches} mixed-adapter batch(es) of {batch_size}")


# --- another revision's engine (--before) -------------------------------------------------
@dataclass(frozen=True)
class Checkout:
    """A source tree whose engine a worker process runs: ``pkg_root`` holds a ``loramux/``
    that links the tree's package folders, to put first on the worker's PYTHONPATH."""

    root: Path
    pkg_root: Path
    sha: str
    rev: str | None = None  # as given to --before; None for this checkout (after)
    modified: bool = False  # engine/ or kernels/ differ from ``sha`` (uncommitted changes)

    @property
    def label(self) -> str:
        return "after" if self.rev is None else f"before, {self.sha[:7]}"


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def link_package(tree: Path, dest: Path) -> Path:
    """``dest/loramux/<name>`` -> each folder ``tree``'s pyproject maps ``loramux.<name>``
    to (its ``package-dir``); ``dest``, to put on ``sys.path`` ahead of the installed one."""
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    package = dest / "loramux"
    package.mkdir(parents=True)
    for name, folder in mapping.items():
        top, _, sub = name.partition(".")
        if top == "loramux" and sub and "." not in sub and (tree / folder).is_dir():
            (package / sub).symlink_to((tree / folder).resolve(), target_is_directory=True)
    if not (package / "engine").is_dir():
        raise RuntimeError(f"{tree}'s pyproject maps no loramux.engine folder")
    return dest


def after_checkout(workdir: Path) -> Checkout:
    """This working tree, as the after engine's source."""
    modified = bool(_git("status", "--porcelain", "--", "engine", "kernels"))
    return Checkout(
        root=REPO_ROOT,
        pkg_root=link_package(REPO_ROOT, workdir / "after"),
        sha=_git("rev-parse", "HEAD"),
        modified=modified,
    )


def resolve_commit(rev: str) -> str:
    """The full sha of commit ``rev``; a RuntimeError naming it when there is none."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except RuntimeError:
        raise RuntimeError(f"--before {rev!r} is not a commit of this repository") from None


@contextlib.contextmanager
def before_checkout(rev: str, workdir: Path) -> Iterator[Checkout]:
    """Revision ``rev`` in a temporary ``git worktree`` under ``workdir``, removed on exit
    (also when the body raises)."""
    sha = resolve_commit(rev)
    tree = workdir / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(tree), sha)
    try:
        yield Checkout(
            root=tree,
            pkg_root=link_package(tree, workdir / "before"),
            sha=sha,
            rev=rev,
        )
    finally:
        remove_worktree(tree)


def remove_worktree(tree: Path) -> None:
    try:
        _git("worktree", "remove", "--force", str(tree))
    except RuntimeError as exc:
        print(f"{exc}; deleting {tree} and pruning", file=sys.stderr)
        shutil.rmtree(tree, ignore_errors=True)
        _git("worktree", "prune")


def run_engine_worker(checkout: Checkout, job: dict, workdir: Path) -> RunResult:
    """One engine run (``run_engine``) in a worker process importing ``checkout``'s loramux."""
    job_path = workdir / "job.json"
    result_path = workdir / "result.json"
    result_path.unlink(missing_ok=True)
    write_atomic(job_path, json.dumps({**job, "expect_root": str(checkout.root.resolve())}))
    paths = [str(checkout.pkg_root), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(job_path), str(result_path)], env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {checkout.label} engine's worker exited {done.returncode}")
    raw = json.loads(result_path.read_text())
    run = RunResult(
        f"engine ({checkout.label})", raw["tokens"], Clock.from_json(raw["clock"]), raw["batch"]
    )
    run.extra = {**raw["extra"], "imported_from": raw["imported_from"]["loramux.engine"]}
    return run


# --- the measurement -----------------------------------------------------------------
def measure(args, model_dir, adapters, prompts, names, pad_id, checkouts=(), workdir=None):
    """Interleaved runs: per repeat a fresh engine (empty prefix cache), then PEFT.

    With ``checkouts`` (``--before``: the after and the before tree), each repeat runs
    every checkout's engine in a worker process (its files in ``workdir``), in alternating
    order, before PEFT.
    Returns the engine runs by label, the PEFT runs by batch size, the profile's path.
    """
    model = build_peft(model_dir, adapters)
    engine_runs: dict[str, list[RunResult]] = {}
    peft_runs: dict[int, list[RunResult]] = {bs: [] for bs in args.peft_batch_sizes}
    profile_path = None
    job = {
        "model_dir": str(model_dir),
        "adapters": [
            {"name": a.name, "path": str(a.path), "rank": a.rank, "targets": list(a.targets)}
            for a in adapters
        ],
        "prompts": prompts,
        "names": names,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "threads": torch.get_num_threads(),
    }
    for repeat in range(args.repeats):
        if checkouts:
            order = checkouts if repeat % 2 == 0 else checkouts[::-1]
            for checkout in order:
                run = run_engine_worker(checkout, job, workdir)
                engine_runs.setdefault(checkout.label, []).append(run)
                _report_run(run, repeat)
        else:
            engine = build_engine(model_dir, adapters, args.requests)
            run = run_engine(engine, prompts, names, args.max_tokens)
            engine_runs.setdefault("engine", []).append(run)
            _report_run(run, repeat)
            if args.profile and repeat == args.repeats - 1:
                profile_path = _profile(args, engine, prompts, names)
            del engine
            gc.collect()
        for batch_size in args.peft_batch_sizes:
            run = run_peft(model, prompts, names, pad_id, args.max_tokens, batch_size)
            peft_runs[batch_size].append(run)
            _report_run(run, repeat)
    if checkouts and args.profile:  # the after engine, in this process this time
        engine = build_engine(model_dir, adapters, args.requests)
        warm_up(engine, names)
        profile_path = _profile(args, engine, prompts, names)
    return engine_runs, peft_runs, profile_path


def _profile(args, engine, prompts, names) -> Path:
    path = args.out.with_name(args.out.stem + "_engine_profile.txt")
    profile_engine(engine, prompts, names, args.max_tokens, path)
    print(f"profile written to {path}", flush=True)
    return path


def _report_run(run: RunResult, repeat: int) -> None:
    c = run.clock.summary()
    print(
        f"[{repeat}] {run.label}: {run.num_tokens} tokens in {run.seconds:.2f} s = "
        f"{run.tokens_per_s:.1f} tok/s (cores used {c['cores_used']}, load "
        f"{c['loadavg_1m_before']} -> {c['loadavg_1m_after']})",
        flush=True,
    )


# --- comparison and reporting ----------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {
        "identical_requests": same,
        "requests": len(a),
        "fraction": round(same / len(a), 4),
        "mean_common_prefix_tokens": round(sum(prefixes) / len(prefixes), 2),
        "min_common_prefix_tokens": min(prefixes),
    }


def render_markdown(report: dict) -> str:
    cfg, m, eng = report["config"], report["machine"], report["engine"]
    before = report.get("engine_before")
    repeats = cfg["repeats"]
    lines = [
        "# Engine vs transformers + PEFT (mixed-adapter generate), CPU",
        "",
        f"{cfg['model']}, {cfg['requests']} concurrent requests over {cfg['adapters']} "
        f"adapters (ranks {sorted(set(cfg['adapter_ranks']))}, targets q/k/v/o or all "
        f"seven; request i uses adapter i % {cfg['adapters']}), {cfg['max_tokens']} new "
        "tokens each (EOS suppressed), greedy, float32. Both measured in the same run on "
        "the same prompt token ids"
        + (f"; best of {repeats} interleaved runs each." if repeats > 1 else "."),
        "",
        "| system | batching | requests | tokens | wall s | tokens/s | cores used | "
        f"greedy agreement with engine{' (after)' if before else ''} |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    if before:
        agree = before["agreement_with_after"]
        lines.append(
            f"| loramux engine (before, {before['sha'][:7]}) | {before['batch']} "
            f"| {before['requests']} | {before['tokens']} | {before['seconds']:.2f} "
            f"| {before['tokens_per_s']:.1f} | {before['cores_used']} "
            f"| {_agreement_text(agree)} |"
        )
    lines.append(
        f"| loramux engine{' (after)' if before else ''} | {eng['batch']} | {eng['requests']} "
        f"| {eng['tokens']} | {eng['seconds']:.2f} | {eng['tokens_per_s']:.1f} "
        f"| {eng['cores_used']} | - |"
    )
    for run in report["peft_runs"]:
        agree = run["agreement_with_engine"]
        mark = " (baseline)" if run["label"] == report["baseline"] else ""
        lines.append(
            f"| transformers + PEFT{mark} | {run['batch']} | {run['requests']} | "
            f"{run['tokens']} | {run['seconds']:.2f} | {run['tokens_per_s']:.1f} | "
            f"{run['cores_used']} | {_agreement_text(agree)} |"
        )
    ratio, target = report["ratio_engine_over_peft"], report["target_ratio"]
    verdict = "met" if ratio >= target else "not met"
    lines += [
        "",
        f"**Ratio engine{' (after)' if before else ''} / PEFT ({report['baseline']}): "
        f"{ratio:.2f}x** (target >= {target:g}x: {verdict}).",
        "",
        f"Engine{' (after)' if before else ''}: TTFT median {eng['ttft_median_s']} s, max "
        f"{eng['ttft_max_s']} s; preemptions {eng['preemptions']}; cached prompt tokens "
        f"{eng['cached_prompt_tokens']}.",
        "",
        "*cores used* = this process's CPU seconds / wall seconds during the timed part "
        f"(torch uses {m['torch_threads']} threads): well below {m['torch_threads']} means "
        "other processes were competing for the cores while it was measured.",
    ]
    if before:
        head = eng["checkout"]
        changes = (
            " with uncommitted changes in engine/ or kernels/"
            if head["engine_or_kernels_modified"]
            else ""
        )
        lines += [
            "",
            f"**Engine after / before: {report['ratio_after_over_before']:.2f}x tokens/s**; "
            f"greedy tokens {_agreement_text(before['agreement_with_after'])}. Before: "
            f"`{before['rev']}` = {before['sha'][:12]}; after: this checkout at "
            f"{head['head'][:12]}{changes}. Both engines ran in {report['engines_in']}, in "
            "alternating order, each importing loramux from its own tree (before: "
            f"`{before['imported_from']}`).",
        ]
    if report["contended"]:
        lines += [
            "",
            "**Warning: the machine was busy during the reported runs** (1-minute load "
            f"average up to {report['reported_runs_max_loadavg_1m']} on {m['nproc']} "
            "cores, this process's own threads included); absolute "
            "figures are lower than on an idle machine and the ratio is noisier.",
        ]
    if repeats > 1:
        lines += [
            "",
            "All runs in order, tokens/s (cores used): "
            + (f"engine (before) {_runs_text(before['all_runs'])}; " if before else "")
            + f"engine{' (after)' if before else ''} "
            + _runs_text(eng["all_runs"])
            + "; "
            + "; ".join(f"{r['label']} " + _runs_text(r["all_runs"]) for r in report["peft_runs"])
            + ".",
        ]
    lines += [
        "",
        f"Machine: {m['cpu_model'] or m['processor']}, {m['nproc']} cores "
        f"(torch threads {m['torch_threads']}), {m['mem_total_gib']} GiB, {m['uname']}; "
        f"Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"peft {m['peft']}. Date {m['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)


def _agreement_text(agree: dict) -> str:
    return (
        f"{agree['identical_requests']}/{agree['requests']} identical, mean common prefix "
        f"{agree['mean_common_prefix_tokens']} tokens"
    )


def _brief(run: RunResult) -> dict:
    return {
        "tokens_per_s": round(run.tokens_per_s, 2),
        "cores_used": run.clock.summary()["cores_used"],
    }


def _runs_text(runs: list[dict]) -> str:
    return ", ".join(f"{r['tokens_per_s']:.1f} ({r['cores_used']})" for r in runs)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.before is None:
        return run_benchmark(args)
    # SIGTERM as an exception, so the worktree is removed on the way out as on any error.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:  # (main runs on the main thread: signal handlers can only be set there)
        with tempfile.TemporaryDirectory(prefix="loramux-before-") as tmp:
            workdir = Path(tmp)
            with before_checkout(args.before, workdir) as before:
                after = after_checkout(workdir)
                print(
                    f"before: {args.before} = {before.sha} (worktree {before.root}); after: "
                    f"this checkout at {after.sha}"
                    + (
                        " with uncommitted changes in engine/ or kernels/" if after.modified else ""
                    ),
                    flush=True,
                )
                return run_benchmark(args, (after, before), workdir)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_benchmark(args, checkouts: tuple[Checkout, ...] = (), workdir: Path | None = None) -> int:
    """Prepare, measure, report; ``checkouts`` (after, before) with ``--before``."""
    from transformers import AutoTokenizer

    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    model_dir = prepare_model(args.cache_dir)
    adapters = prepare_adapters(model_dir, args.cache_dir, args.adapters)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, args.requests)
    names = [adapters[i % len(adapters)].name for i in range(args.requests)]
    pad_id = tokenizer.eos_token_id
    print(
        f"{args.requests} requests, {args.adapters} adapters, {args.max_tokens} tokens each; "
        f"prompt lengths {min(map(len, prompts))}..{max(map(len, prompts))}",
        flush=True,
    )

    engine_runs, peft_runs, profile_path = measure(
        args, model_dir, adapters, prompts, names, pad_id, checkouts, workdir
    )
    after_runs = engine_runs[checkouts[0].label if checkouts else "engine"]
    before_runs = engine_runs[checkouts[1].label] if checkouts else []
    eng = _best(after_runs)
    best_peft = [_best(runs) for runs in peft_runs.values()]
    baseline = _best(best_peft)
    reported = [eng, *best_peft]  # were the figures we report taken on a busy machine?
    if before_runs:
        reported.append(_best(before_runs))
    max_load = max(max(r.clock.load_before, r.clock.load_after) for r in reported)
    min_cores = min(r.clock.cpu_seconds / r.seconds for r in reported)
    report = {
        "benchmark": "engine_vs_peft",
        "config": {
            "model": MODEL_NAME,
            "requests": args.requests,
            "adapters": args.adapters,
            "adapter_ranks": [a.rank for a in adapters],
            "adapter_targets": [list(a.targets) for a in adapters],
            "adapter_init_std": ADAPTER_STD,
            "max_tokens": args.max_tokens,
            "dtype": "float32",
            "greedy": True,
            "fixed_length": "engine min_tokens=max_tokens; PEFT min_new_tokens=max_new_tokens",
            "prompt_tokens": [len(p) for p in prompts],
            "engine_config": {
                "kv_cache_bytes": 512 * 1024**2,
                "max_num_seqs": max(64, args.requests),
                "max_num_batched_tokens": 2048,
            },
            "peft_batch_sizes": args.peft_batch_sizes,
            "repeats": args.repeats,
        },
        "machine": machine,
        "engine": _engine_entry(eng, after_runs),
        "peft_runs": [
            {
                **best.summary(),
                "all_runs": [_brief(r) for r in runs],
                "agreement_with_engine": agreement(eng.tokens, best.tokens),
            }
            for best, runs in zip(best_peft, peft_runs.values(), strict=True)
        ],
        "baseline": baseline.label,
        "ratio_engine_over_peft": round(eng.tokens_per_s / baseline.tokens_per_s, 3),
        "target_ratio": 5.0,
        "greedy_agreement": agreement(eng.tokens, baseline.tokens),
        "reported_runs_max_loadavg_1m": round(max_load, 2),
        "contended": max_load > machine["nproc"] + 0.5
        or min_cores < 0.75 * torch.get_num_threads(),
        "command": " ".join([".venv/bin/python", "benchmarks/engine_vs_peft.py", *sys.argv[1:]]),
    }
    if checkouts:
        after, before = checkouts
        old = _best(before_runs)
        report["engine"]["checkout"] = {
            "head": after.sha,
            "engine_or_kernels_modified": after.modified,
        }
        report["engine_before"] = {
            **_engine_entry(old, before_runs),
            "rev": before.rev,
            "sha": before.sha,
            "agreement_with_after": agreement(eng.tokens, old.tokens),
        }
        report["ratio_after_over_before"] = round(eng.tokens_per_s / old.tokens_per_s, 3)
        report["engines_in"] = "worker processes (engine_vs_peft_worker.py), one per run"
    if profile_path is not None:
        report["engine_profile"] = profile_path.name
    write_atomic(args.out, json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    write_atomic(args.out.with_suffix(".md"), markdown)
    print()
    print(markdown)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def _best(runs: list[RunResult]) -> RunResult:
    return max(runs, key=lambda r: r.tokens_per_s)


def _engine_entry(best: RunResult, runs: list[RunResult]) -> dict:
    return {
        **best.summary(),
        "all_runs": [_brief(r) for r in runs],
        "runs_identical": all(r.tokens == best.tokens for r in runs),
    }


if __name__ == "__main__":
    raise SystemExit(main())
