"""The one shape of a benchmark study: a name under ``loramux bench``, and a runner module.

A study's runner module has ``add_options(parser)``, ``run(args) -> int`` (the exit
status) and, where some options rule others out, ``check(parser, args)`` (a bad
combination is a usage error naming the options; without one, ``--out`` is checked).
``loramux bench NAME [options]`` finds the study in ``benchmarks.bench.STUDIES``, imports
its runner only then, builds its parser, checks and runs it. A study that is also run as
``python -m loramux.benchmarks.<package>`` has a ``__main__`` that calls ``Study.main``.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from dataclasses import dataclass, field
from types import ModuleType

from loramux.benchmarks.common.files import check_output_options


@dataclass(frozen=True)
class Study:
    name: str  # ``loramux bench NAME``
    summary: str  # one line, for ``loramux bench -h``
    runner: str  # the module: add_options, run and maybe check
    defaults: dict = field(default_factory=dict)  # set before add_options (a preset's name)
    description: str | None = None  # the parser's (default: the runner's first paragraph)

    def module(self) -> ModuleType:
        return importlib.import_module(self.runner)

    def parser(self) -> argparse.ArgumentParser:
        module = self.module()
        first_paragraph = (module.__doc__ or "").split("\n\n")[0].strip()
        parser = argparse.ArgumentParser(
            prog=f"loramux bench {self.name}",
            description=self.description or first_paragraph or self.summary,
        )
        parser.set_defaults(**self.defaults)
        module.add_options(parser)
        return parser

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """The options; ``args.argv`` is what was parsed and ``args.command_line`` the
        command as typed, for the report."""
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = self.parser()
        args = parser.parse_args(argv)
        getattr(self.module(), "check", check_output_options)(parser, args)
        args.argv = argv
        args.command_line = shlex.join(["loramux", "bench", self.name, *argv])
        return args

    def main(self, argv: list[str] | None = None) -> int:
        return self.module().run(self.parse(argv))
