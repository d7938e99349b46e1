"""``loramux bench prefill-flood``: how long one tenant's prompts hold another tenant's first
token (issue 33's four attacks), and what the attacker is billed for them.

The platform runs in-process as ``loramux serve`` runs it (the 4-bit GGUF unless
``--model``) with the hostile test's server settings, ``SETTINGS``, and two tenants of
priority 5 and weight 1, ``attacker`` and ``victim``. The victim's probe is a streamed
completion of ``PROBE_SHAPE`` (random prompt token ids, greedy, exactly that many tokens).

* **idle**: ``--idle-probes`` probes one after another (after two untimed warm-ups);
* each **attack** (``ATTACKS``), then: the attacker sends it; once the engine is busy with
  it, the victim probes every ``--probe-interval`` seconds, ``--probes`` times; then the
  attacker's client goes away (its requests are aborted) and the run waits until the
  engine is idle. The echo attack's client leaves after ``LEAVE_AFTER_S`` instead, so the
  victim's probes show what an abandoned request still holds.

Delivered against billed: the usage records of each attack's requests (the attacker's
prompt tokens billed, including those of requests abandoned mid-prefill) and the victim's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loramux.benchmarks.common.bench_server import Target, open_platform, run_apart, serve_platform
from loramux.benchmarks.common.files import (
    add_output_options,
    check_sized,
)
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.prompts import Prompts
from loramux.benchmarks.prefill_flood.report import write_results

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


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="small attacks, for the test")
    parser.add_argument(
        "--model", type=Path, help="HF-format model folder (default: the embedded GGUF)"
    )
    parser.add_argument("--idle-probes", type=int, help="victim probes on the idle engine")
    parser.add_argument("--probes", type=int, help="victim probes during each attack")
    parser.add_argument("--probe-interval", type=float, help="seconds between probes")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_sized(parser, args, SIZES, ("idle_probes", "probes", "probe_interval"))


def _victim(target: Target):
    import openai

    key = target.tenants["victim"]["key"]
    return openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=key, max_retries=0, timeout=600)


def _admin(target: Target) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=target.url, headers=target.admin_headers, timeout=60)


async def _probe(client, target: Target, prompts: Prompts, phase: str, t0: float) -> Probe:
    import openai

    probe = Probe(phase, time.perf_counter() - t0)
    try:
        stream = await client.completions.create(
            model=target.model,
            prompt=prompts(PROBE_SHAPE[0]),
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


async def _until_idle(admin: httpx.AsyncClient) -> float:
    """When (``time.perf_counter()``) the engine was first seen idle, polling from now."""
    deadline = time.perf_counter() + IDLE_WAIT_S
    while time.perf_counter() < deadline:
        body = (await admin.get("/admin/engine")).json()
        if body["running_requests"] == 0 and body["waiting_requests"] == 0:
            break
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
    now = lambda: time.perf_counter() - t0  # noqa: E731
    run, victim = AttackRun(attack.name, now()), _victim(target)
    run.sent_prompt_tokens = attack.prompts * attack.prompt_tokens
    headers = {"Authorization": f"Bearer {target.tenants['attacker']['key']}"}
    async with (
        httpx.AsyncClient(base_url=target.url, timeout=3600, headers=headers) as http,
        _admin(target) as admin,
    ):
        bodies = attack.bodies(prompts)
        tasks = [
            asyncio.create_task(http.post("/v1/completions", json={"model": target.model, **b}))
            for b in bodies
        ]
        # Until /admin/engine shows the attacker with requests running.
        while not all(task.done() for task in tasks):
            rows = (await admin.get("/admin/engine")).json()["tenants"]
            if any(r["tenant_name"] == "attacker" and r["running_requests"] for r in rows):
                break
            await asyncio.sleep(0.05)
        run.busy_s = now()
        idle: asyncio.Task | None = None

        def leave() -> asyncio.Task:
            """The attacker's client goes away: its connections close mid-request."""
            for task in tasks:
                task.cancel()
            run.left_s = now()
            return asyncio.create_task(_until_idle(admin))

        if attack.echo:
            await asyncio.sleep(LEAVE_AFTER_S)
            idle = leave()
        probes = []
        for _ in range(args.probes):
            start = time.perf_counter()
            probes.append(await _probe(victim, target, prompts, attack.name, t0))
            await asyncio.sleep(max(0.0, args.probe_interval - (time.perf_counter() - start)))
        if idle is None:
            idle = leave()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, httpx.Response):
                run.outcomes.append(str(result.status_code))
                if result.status_code == 200:
                    usage = result.json()["usage"]
                    run.delivered_completion_tokens += usage["completion_tokens"]
            else:
                run.outcomes.append(type(result).__name__)
        run.idle_s = await idle - t0
        run.usage = await _usage_rows(admin, target.tenants["attacker"]["id"], seen)
    await victim.close()
    return run, probes


async def _run(args, target: Target) -> dict:
    prompts, victim = Prompts(target.vocab_size, target.avoid), _victim(target)
    t0 = time.perf_counter()
    # Warm-ups (their times not counted, their tokens billed all the same).
    idle = [await _probe(victim, target, prompts, "warmup", t0) for _ in "ab"]
    for _ in range(args.idle_probes):
        idle.append(await _probe(victim, target, prompts, "idle", t0))
        await asyncio.sleep(0.2)
    await victim.close()
    attacks, probes, seen = [], list(idle), set()
    for attack in ATTACKS["smoke" if args.smoke else "full"]:
        run, during = await _attack(args, target, attack, prompts, t0, seen)
        attacks.append(asdict(run))
        probes.extend(during)
    async with _admin(target) as admin:
        victim_usage = await _usage_rows(admin, target.tenants["victim"]["id"], set())
    return {
        "probes": [asdict(p) for p in probes],
        "attacks": attacks,
        "victim_usage": victim_usage,
    }


def run_clients(args: argparse.Namespace, target: Target) -> dict:
    """The client side, in a process of its own."""
    return asyncio.run(_run(args, target))


def run(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    with serve_platform(args.model, **SETTINGS) as platform:
        tenants = [{"name": name, "priority": 5, "weight": 1.0} for name in ("attacker", "victim")]
        raw = run_apart(run_clients, args, open_platform(platform, tenants))
        engine = platform.context.engine.engine
        raw["engine"] = {
            "threads": engine.threads.describe(),
            "step_target_s": engine.config.step_target_s,
            "prefill_budget_tokens": engine.prefill_budget.tokens(),
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        }
    report = {
        "preset": NAME,
        "command": args.command_line,
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
    }
    write_results(args.out / f"bench_{NAME}{'-smoke' if args.smoke else ''}", report, raw)
    return 0
