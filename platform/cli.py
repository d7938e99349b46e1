"""The ``loramux`` command line."""

from __future__ import annotations

import argparse
import sys

SERVE_HELP = (
    "Start the platform (HTTP API, engine in-process) on the embedded default unless "
    "LORAMUX_* settings point elsewhere."
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
    return parser


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loramux.platform.app import create_app
    from loramux.platform.context import build_context
    from loramux.platform.settings import Settings

    overrides = {
        key: value
        for key, value in {"host": args.host, "port": args.port, "data_dir": args.data_dir}.items()
        if value is not None
    }
    settings = Settings(**overrides)
    context = build_context(settings, log=lambda msg: print(msg, flush=True))
    print(_banner(context), flush=True)
    uvicorn.run(create_app(context), host=settings.host, port=settings.port, log_level="info")
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
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
