"""``loramux bench prefill-flood``: how long one tenant's prompts hold another tenant's first
token (issue 33's four attacks), and what the attacker is billed for them.

The platform runs in-process on the embedded default as ``loramux serve`` runs it (SQLite,
the 4-bit GGUF, default engine settings) with the hostile test's server settings: 16
slots, a 512 MiB KV budget, two tenants of priority 5 and weight 1 (``attacker`` and
``victim``). The victim's probe is a streamed completion of ``PROBE_SHAPE`` (random prompt
token ids, greedy, exactly that many output tokens) sent with the ``openai`` client.

* **idle**: ``--idle-probes`` probes one after another (after two untimed warm-ups);
* each **attack**, then: the attacker sends it; once the engine is busy with it, the victim
  probes every ``--probe-interval`` seconds, ``--probes`` times; then the attacker's client
  goes away (its requests are aborted) and the run waits until the engine is idle. The
  attacks (``ATTACKS``, the issue's sizes unless ``--smoke``): one request carrying 32
  prompts of 400 tokens; 32 separate 400-token requests; one 3,000-token prompt; and a
  prompt list with ``echo`` and prompt ``logprobs`` whose client leaves after
  ``LEAVE_AFTER_S`` (the victim's probes then show what an abandoned request still holds).

Victim TTFT is reported against its idle median (P50 and P99 ratios; the goals are 5x and
20x). Delivered against billed: the usage records of each attack's requests (the attacker's
prompt tokens billed, including those of requests abandoned mid-prefill) and the victim's.
The clients run in a spawned process of their own, so that the server's engine thread and
event loop never wait on the clients' interpreter.

    loramux bench prefill-flood                 # the issue's sizes on SmolLM2 (minutes)
    loramux bench prefill-flood --smoke --out DIR   # seconds, for the test
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    fill_sizes,
    write_report,
)
from loramux.benchmarks.common.machine import Clock, machine_info
from loramux.benchmarks.prefill_flood_report import render_markdown, summarize, write_plots

NAME = "prefill-flood"
SETTINGS = {"max_num_seqs": 16, "kv_cache_bytes": 512 << 20}  # the hostile test's server
PROBE_SHAPE = (16, 8)  # the victim's prompt and output tokens
LEAVE_AFTER_S = 2.0  # the echo attacker's client leaves this long after sending
IDLE_WAIT_S = 600.0  # the longest wait for the engine to go idle after an attack


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    prompts: int  # prompts of `prompt_tokens` tokens
    prompt_tokens: int
    requests: int  # the prompts in this many requests (1: one prompt list)
    echo: bool = False  # echo with prompt logprobs; the client leaves after LEAVE_AFTER_S

    def bodies(self, prompt) -> list[dict]:
        prompts = [prompt(self.prompt_tokens) for _ in range(self.prompts)]
        extra = {"echo": True, "logprobs": 1, "max_tokens": 1} if self.echo else {}
        if self.requests == 1:
            return [{"prompt": prompts, "max_tokens": 8, **extra}]
        return [{"prompt": p, "max_tokens": 8, **extra} for p in prompts]


ATTACKS = {
    "full": (
        Attack("prompt-list", "one request, 32 prompts x 400 tokens", 32, 400, 1),
        Attack("separate-requests", "32 requests of 400 tokens", 32, 400, 32),
        Attack("long-prompt", "one 3,000-token prompt", 1, 3000, 1),
        Attack("echo-abandoned", "128 x 800 echo + logprobs, client gone", 128, 800, 1, True),
    ),
    "smoke": (
        Attack("prompt-list", "one request, 4 prompts x 64 tokens", 4, 64, 1),
        Attack("separate-requests", "4 requests of 64 tokens", 4, 64, 4),
        Attack("long-prompt", "one 256-token prompt", 1, 256, 1),
        Attack("echo-abandoned", "4 x 64 echo + logprobs, client gone", 4, 64, 1, True),
    ),
}
SIZES = {
    "full": dict(idle_probes=10, probes=12, probe_interval=1.0),
    "smoke": dict(idle_probes=2, probes=2, probe_interval=0.2),
}


@dataclass
class Probe:
    phase: str  # "idle" or the attack's name
    sent_s: float
    ttft_s: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class AttackRun:
    name: str
    started_s: float
    busy_s: float | None = None  # when the engine was first seen busy with it
    left_s: float | None = None  # when the attacker's client went away
    idle_s: float | None = None  # when the engine was idle again
    outcomes: list[str] = field(default_factory=list)  # per request: status or error
    sent_prompt_tokens: int = 0
    delivered_completion_tokens: int = 0  # in the responses that reached the client
    usage: list[dict] = field(default_factory=list)  # its requests' usage records


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"loramux bench {NAME}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="small attacks, for the test")
    parser.add_argument(
        "--model", type=Path, help="HF-format model folder (default: the embedded GGUF)"
    )
    parser.add_argument("--idle-probes", type=int, help="victim probes on the idle engine")
    parser.add_argument("--probes", type=int, help="victim probes during each attack")
    parser.add_argument("--probe-interval", type=float, help="seconds between probes")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    fill_sizes(args, SIZES)
    if min(args.idle_probes, args.probes) <= 0 or args.probe_interval <= 0:
        parser.error("probe counts and the interval must be positive")
    args.command = " ".join([f"loramux bench {NAME}", *argv])
    return args


@dataclass(frozen=True)
class Target:
    """The running platform and its tenants, as the client process needs them."""

    url: str
    admin_headers: dict[str, str]
    model: str
    ids: dict[str, str]  # tenant name -> id
    keys: dict[str, str]  # tenant name -> API key
    vocab_size: int
    avoid: tuple[int, ...]  # token ids never put in a prompt (EOS)


class Prompts:
    """Random prompt token ids, a fresh prompt each call (no prefix-cache hits)."""

    def __init__(self, target: Target, seed: int = 0):
        avoid = set(target.avoid)
        self._ids = np.array([i for i in range(3, target.vocab_size) if i not in avoid])
        self._rng = np.random.default_rng(seed)

    def __call__(self, length: int) -> list[int]:
        return self._rng.choice(self._ids, size=length).tolist()


async def _probe(client, target: Target, prompt: list[int], phase: str, t0: float) -> Probe:
    import openai

    probe = Probe(phase, time.perf_counter() - t0)
    try:
        stream = await client.completions.create(
            model=target.model,
            prompt=prompt,
            max_tokens=PROBE_SHAPE[1],
            temperature=0,
            stream=True,
            extra_body={"min_tokens": PROBE_SHAPE[1]},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and probe.ttft_s is None:
                probe.ttft_s = time.perf_counter() - t0 - probe.sent_s
            probe.tokens += sum(1 for c in chunk.choices if c.text)
    except openai.APIError as exc:
        probe.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return probe


async def _engine_busy(admin: httpx.AsyncClient, tenant: str) -> bool:
    """Whether ``/admin/engine`` shows ``tenant`` with requests running."""
    rows = (await admin.get("/admin/engine")).json()["tenants"]
    return any(r["tenant_name"] == tenant and r["running_requests"] > 0 for r in rows)


async def _engine_idle(admin: httpx.AsyncClient) -> bool:
    body = (await admin.get("/admin/engine")).json()
    return body["running_requests"] == 0 and body["waiting_requests"] == 0


async def _until_idle(admin: httpx.AsyncClient) -> float:
    """When (``time.perf_counter()``) the engine was first seen idle, polling from now."""
    deadline = time.perf_counter() + IDLE_WAIT_S
    while not await _engine_idle(admin) and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    return time.perf_counter()


async def _usage_rows(admin: httpx.AsyncClient, tenant_id: str, seen: set[str]) -> list[dict]:
    """The tenant's usage records not in ``seen`` (which they are added to)."""
    got = await admin.get("/admin/usage", params={"tenant_id": tenant_id, "group_by": "request"})
    got.raise_for_status()
    rows = [row for row in got.json()["rows"] if row["request_id"] not in seen]
    seen.update(row["request_id"] for row in rows)
    return rows


async def _attack(args, target: Target, attack: Attack, prompts: Prompts, t0: float, seen):
    """One attack and the victim's probes during it (``seen``: usage records already read)."""
    import openai

    now = lambda: time.perf_counter() - t0  # noqa: E731
    run = AttackRun(attack.name, now())
    victim = openai.AsyncOpenAI(
        base_url=f"{target.url}/v1", api_key=target.keys["victim"], max_retries=0, timeout=600
    )
    headers = {"Authorization": f"Bearer {target.keys['attacker']}"}
    async with (
        httpx.AsyncClient(base_url=target.url, timeout=3600, headers=headers) as http,
        httpx.AsyncClient(base_url=target.url, headers=target.admin_headers, timeout=60) as admin,
    ):
        bodies = attack.bodies(prompts)
        tasks = [
            asyncio.create_task(http.post("/v1/completions", json={"model": target.model, **b}))
            for b in bodies
        ]
        while not await _engine_busy(admin, "attacker"):
            if all(task.done() for task in tasks):
                break
            await asyncio.sleep(0.05)
        run.busy_s = now()
        idle: asyncio.Task | None = None
        if attack.echo:
            await asyncio.sleep(LEAVE_AFTER_S)
            _leave(tasks)
            run.left_s = now()
            idle = asyncio.create_task(_until_idle(admin))
        probes = []
        for _ in range(args.probes):
            start = time.perf_counter()
            probes.append(await _probe(victim, target, prompts(PROBE_SHAPE[0]), attack.name, t0))
            await asyncio.sleep(max(0.0, args.probe_interval - (time.perf_counter() - start)))
        if run.left_s is None:
            _leave(tasks)
            run.left_s = now()
            idle = asyncio.create_task(_until_idle(admin))
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, httpx.Response):
                run.outcomes.append(str(result.status_code))
                if result.status_code == 200:
                    usage = result.json()["usage"]
                    run.delivered_completion_tokens += usage["completion_tokens"]
            else:
                run.outcomes.append(type(result).__name__)
        run.sent_prompt_tokens = attack.prompts * attack.prompt_tokens
        run.idle_s = await idle - t0
        run.usage = await _usage_rows(admin, target.ids["attacker"], seen)
    await victim.close()
    return run, probes


def _leave(tasks: list[asyncio.Task]) -> None:
    """The attacker's client goes away: its connections close mid-request."""
    for task in tasks:
        task.cancel()


async def _run(args, target: Target) -> dict:
    import openai

    prompts = Prompts(target)
    t0 = time.perf_counter()
    victim = openai.AsyncOpenAI(
        base_url=f"{target.url}/v1", api_key=target.keys["victim"], max_retries=0, timeout=600
    )
    # Warm-ups (their times not counted, their tokens billed all the same).
    idle = [await _probe(victim, target, prompts(PROBE_SHAPE[0]), "warmup", t0) for _ in "ab"]
    for _ in range(args.idle_probes):
        idle.append(await _probe(victim, target, prompts(PROBE_SHAPE[0]), "idle", t0))
        await asyncio.sleep(0.2)
    await victim.close()
    attacks, probes, seen = [], list(idle), set()
    for attack in ATTACKS["smoke" if args.smoke else "full"]:
        run, during = await _attack(args, target, attack, prompts, t0, seen)
        attacks.append(asdict(run))
        probes.extend(during)
    async with httpx.AsyncClient(
        base_url=target.url, headers=target.admin_headers, timeout=60
    ) as admin:
        victim_usage = await _usage_rows(admin, target.ids["victim"], set())
    return {
        "probes": [asdict(p) for p in probes],
        "attacks": attacks,
        "victim_usage": victim_usage,
    }


def run_clients(args: argparse.Namespace, target: Target) -> dict:
    """The client side, in a process of its own."""
    return asyncio.run(_run(args, target))


def _create_tenants(platform) -> tuple[dict[str, str], dict[str, str]]:
    """``attacker`` and ``victim``, priority 5, weight 1: (name -> id, name -> key)."""
    ids, keys = {}, {}
    with httpx.Client(base_url=platform.url, headers=platform.admin_headers, timeout=60) as c:
        for name in ("attacker", "victim"):
            made = c.post("/admin/tenants", json={"name": name, "priority": 5, "weight": 1.0})
            made.raise_for_status()
            key = c.post(f"/admin/tenants/{made.json()['id']}/api-keys")
            key.raise_for_status()
            ids[name], keys[name] = made.json()["id"], key.json()["key"]
    return ids, keys


def main(argv: list[str] | None = None) -> int:
    from loramux.benchmarks.common.bench_server import serve_platform

    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    load_before = os.getloadavg()
    with serve_platform(args.model, **SETTINGS) as platform:
        engine = platform.context.engine.engine
        ids, keys = _create_tenants(platform)
        config = engine.model_config
        target = Target(
            platform.url,
            platform.admin_headers,
            platform.base_model,
            ids,
            keys,
            config.vocab_size,
            tuple(sorted(engine.eos_token_ids)),
        )
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as clients, Clock() as clock:
            run = clients.submit(run_clients, args, target).result()
        run["clock"] = {"seconds": round(clock.seconds, 1), **clock.summary()}
        run["engine"] = {
            "threads": engine.threads.describe(),
            "step_target_s": engine.config.step_target_s,
            "prefill_budget_tokens": engine.prefill_budget.tokens(),
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        }
    report = {
        "preset": NAME,
        "command": args.command,
        "model": "embedded default (SmolLM2-135M-Instruct, 4-bit GGUF)"
        if args.model is None
        else args.model.name,
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "settings": SETTINGS,
        "config": {k: getattr(args, k) for k in ("smoke", *SIZES["full"])}
        | {"probe_prompt_tokens": PROBE_SHAPE[0], "probe_output_tokens": PROBE_SHAPE[1]},
        "attacks": [asdict(a) for a in ATTACKS["smoke" if args.smoke else "full"]],
        **summarize(run),
        "raw": run,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{NAME}{'-smoke' if args.smoke else ''}"
    plots = write_plots(report, stem)
    write_report(stem, report, render_markdown(report, plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
