"""The ``loramux`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from loramux.platform.cli_operator import add_operator_commands

SERVE_HELP = (
    "Start the platform (HTTP API, engine in-process) on the embedded default unless "
    "LORAMUX_* settings point elsewhere."
)


ENGINE_HELP = (
    "Start one engine process (one per accelerator) serving the internal engine API; it "
    "registers in Redis so platforms with LORAMUX_ENGINE_MODE=remote route requests to it."
)

# Commands whose code is not the product's (``bench``: the benchmarks) are found through this
# entry-point group when they run (pyproject.toml declares them), so the platform never
# imports them by name.
COMMANDS_GROUP = "loramux.commands"

BENCH_HELP = (
    "Serve a preset workload and report it against its baseline in the same run: "
    "transformers + PEFT (latency percentiles, throughput, SLO attainment, tenant shares, "
    "plots; engine-vs-peft: tokens/s and greedy agreement), for lora-overhead the same "
    "engine serving the base model alone, for adapter-churn the same trace with every "
    "adapter resident; or the soak."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loramux",
        description="loramux: many tenants' LoRA adapters served on one shared base model.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    serve.add_argument("--host", help="bind address (default: LORAMUX_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: LORAMUX_PORT or 8000)")
    serve.add_argument(
        "--data-dir", help="data directory (default: LORAMUX_DATA_DIR or ./.loramux)"
    )
    serve.set_defaults(handler=_serve)
    engine = commands.add_parser("engine", help=ENGINE_HELP, description=ENGINE_HELP)
    engine.add_argument(
        "--host", help="bind address (default: LORAMUX_ENGINE_SERVER_HOST or 127.0.0.1)"
    )
    engine.add_argument(
        "--port", type=int, help="port (default: LORAMUX_ENGINE_SERVER_PORT or 8100)"
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="one engine over this many GPUs, one process each "
        "(default: LORAMUX_ENGINE_TENSOR_PARALLEL_SIZE or 1)",
    )
    engine.set_defaults(handler=_engine)
    bench = commands.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP)
    bench.add_argument(
        "args", nargs=argparse.REMAINDER, help="a preset, e.g. cpu-smoke; -h lists all"
    )
    bench.set_defaults(handler=_bench)
    add_operator_commands(commands)  # usage, billing, engines
    return parser


def _bench(args: argparse.Namespace) -> int:
    command = _installed_command("bench")
    if command is None:
        return 2
    return command(args.args)


def _installed_command(name: str) -> Callable[[list[str]], int] | None:
    """The ``main(argv)`` that the installed entry point ``name`` of ``COMMANDS_GROUP``
    names, or None (having said why on stderr) when this installation has none."""
    found = tuple(entry_points(group=COMMANDS_GROUP, name=name))
    if not found:
        print(
            f"loramux {name}: this installation does not provide the {name!r} command (no "
            f"{name!r} entry point in group {COMMANDS_GROUP!r}). Install loramux from its "
            "checkout with `make setup`, or `pip install -e .`, and try again.",
            file=sys.stderr,
        )
        return None
    return found[0].load()


def _serve(args: argparse.Namespace) -> int:
    from loramux.platform.app import create_app
    from loramux.platform.context import build_context
    from loramux.platform.serving import serve
    from loramux.platform.settings import Settings

    overrides = {
        key: value
        for key, value in {"host": args.host, "port": args.port, "data_dir": args.data_dir}.items()
        if value is not None
    }
    settings = Settings(**overrides)
    show_log("loramux.engine", "loramux.requests")
    context = build_context(settings, log=lambda msg: print(msg, flush=True))
    print(_banner(context), flush=True)
    app = create_app(context)
    # On SIGTERM: running requests get shutdown_timeout_s to finish, then are stopped.
    serve(
        app,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        stop_requests=app.state.running_requests.stop_all,
        **serve_options(settings),
    )
    return 0


def show_log(*names: str) -> None:
    """These loggers on stderr from INFO up (the engine's: what its memory budget holds at
    start, adapters thrashing; ``loramux.requests``: a line per request served), unless
    logging is configured already; the rest of the process's logging stays as it was."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in names:
        log = logging.getLogger(name)
        if log.handlers:
            continue
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def serve_options(settings) -> dict:
    """uvicorn's options for ``loramux serve``: where to bind, and a request-head limit above
    the platform's own URL and header caps, so those are answered 414/431 (JSON) rather than
    dropped by uvicorn (see ``loramux.platform.api.middleware.input_guard``)."""
    from loramux.platform.api.middleware.input_guard import UVICORN_LIMITS

    return {"host": settings.host, "port": settings.port, "log_level": "info", **UVICORN_LIMITS}


def _engine(args: argparse.Namespace) -> int:
    from loramux.platform.engine_fleet.server import build_engine_host, create_engine_app
    from loramux.platform.serving import serve
    from loramux.platform.settings import Settings

    overrides = {
        key: value
        for key, value in {
            "engine_host": args.host,
            "engine_port": args.port,
            "tensor_parallel_size": args.tensor_parallel_size,
        }.items()
        if value is not None
    }
    settings = Settings(**overrides)
    if settings.engine_secret is None:
        print(
            "loramux engine needs LORAMUX_ENGINE_SERVER_SECRET (the bearer token platforms use to "
            "reach it); set the same value on the platform.",
            file=sys.stderr,
        )
        return 2
    show_log("loramux.engine")
    host = build_engine_host(settings, log=lambda msg: print(msg, flush=True))
    print(f"loramux engine {host.engine_id} serving {host.model_id} at {host.url}", flush=True)
    app = create_engine_app(host)
    # On SIGTERM: leave the registry, let requests finish for shutdown_timeout_s, abort the rest.
    serve(
        app,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        stop_requests=host.stop_requests,
        on_shutdown=host.withdraw,
        # An engine down for good (a tensor-parallel rank died) ends the process, status 1.
        take_exit=lambda request_exit: setattr(host, "on_down", request_exit),
        host=settings.engine_host,
        port=settings.engine_port,
        log_level="info",
    )
    if host.engine.down is not None:
        print(f"loramux engine {host.engine_id} stopped: {host.engine.down}", file=sys.stderr)
        return 1
    return 0


def _banner(context) -> str:
    settings = context.settings
    base = f"http://{settings.host}:{settings.port}"
    lines = [
        f"loramux serving {context.base_model.model_id} on {base}",
        f"  data directory: {settings.data_dir}",
    ]
    if context.admin_token_created:
        lines += [
            "",
            "Admin token (shown once; also kept in the data directory's admin_token file):",
            f"  {context.admin_token}",
            "",
            "Try it:",
            f"  curl -s {base}/v1/models -H 'Authorization: Bearer {context.admin_token}'",
            "",
            *_walkthrough(base, context.admin_token),
        ]
    return "\n".join(lines)


# Reads one field of the JSON on stdin (python3 is there wherever loramux runs; jq may not be).
_JSON_FIELD = "python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])'"


def _walkthrough(base: str, admin_token: str) -> list[str]:
    """Copy-pasteable shell lines: a tenant, its key, an adapter upload and a completion."""
    return [
        "Create a tenant and an API key, upload a PEFT adapter and call it:",
        f"  BASE={base}",
        f"  ADMIN_TOKEN={admin_token}",
        '  TENANT_ID=$(curl -s $BASE/admin/tenants -H "Authorization: Bearer $ADMIN_TOKEN" '
        f"-H 'Content-Type: application/json' -d '{{\"name\": \"acme\"}}' | {_JSON_FIELD} id)",
        "  API_KEY=$(curl -s $BASE/admin/tenants/$TENANT_ID/api-keys "
        "-H \"Authorization: Bearer $ADMIN_TOKEN\" -H 'Content-Type: application/json' "
        f"-d '{{}}' | {_JSON_FIELD} key)",
        '  curl -s $BASE/v1/adapters -H "Authorization: Bearer $API_KEY" -F name=my-adapter '
        "-F files=@adapter_config.json -F files=@adapter_model.safetensors",
        '  curl -s $BASE/v1/completions -H "Authorization: Bearer $API_KEY" '
        "-H 'Content-Type: application/json' "
        '-d \'{"model": "my-adapter", "prompt": "Hello", "max_tokens": 16}\'',
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
