"""A Go ``text/template`` renderer for the subset of it the loramux Helm chart uses.

The deploy tests render ``deploy/helm/loramux`` with this where no ``helm`` is installed
(CI has none), and compare its output with helm's where one is. It supports actions with
``{{-``/``-}}`` trimming and comments; ``if``/``else if``/``else``, ``range`` (over lists
and maps, with ``$i, $v :=``), ``with``, ``define``, ``template``; variables (``$``,
``:=``, ``=``); field chains on ``.`` and variables; pipelines and parenthesized calls; and
the Helm/Sprig functions in :data:`FUNCTIONS`. Values behave as Helm's do: numbers from
values files are float64 (so ``{{ .Values.big }}`` prints ``1e+06`` as helm does), a
missing map key is empty, a field of nothing is an error. Anything outside the subset
raises :class:`TemplateError`, so a template that strays fails the test instead of
rendering something helm would not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.deploy.template_functions import FUNCTIONS, TemplateError, go_string, go_type, truthy

# --- lexing --------------------------------------------------------------------------------

# An action; `{{- ` and ` -}}` (the dash next to an ASCII space) trim the text beside it.
_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<raw>`[^`]*`)
    | (?P<num>-?\d+(?:\.\d+)?)
    | (?P<declare>:=)
    | (?P<assign>=)
    | (?P<pipe>\|)
    | (?P<lparen>\()
    | (?P<rparen>\))
    | (?P<comma>,)
    | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
    | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.X,
)
_KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block"}


def _tokens(source: str) -> list[tuple[str, str]]:
    if re.search(r"\)\.[A-Za-z_]", source):
        raise TemplateError(f"fields of a parenthesized pipeline are not supported: {source}")
    tokens, position = [], 0
    while position < len(source):
        match = _TOKEN.match(source, position)
        if match is None:
            raise TemplateError(f"cannot read {source[position:]!r} in {{{{{source}}}}}")
        position = match.end()
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
    return tokens


# --- syntax tree ---------------------------------------------------------------------------


@dataclass
class Operand:
    kind: str  # literal | field | var | ident | pipeline
    value: Any  # the literal; field names; (variable, field names); function name; Pipeline


@dataclass
class Pipeline:
    commands: list[list[Operand]]
    declare: list[str] = field(default_factory=list)  # variables set by `:=` or `=`
    assign: bool = False  # `=` (an existing variable) rather than `:=`


@dataclass
class Text:
    text: str


@dataclass
class Action:
    pipeline: Pipeline


@dataclass
class Branch:
    """``if``, ``with`` or ``range``: the body runs for the pipeline, else ``otherwise``."""

    keyword: str
    pipeline: Pipeline
    body: list
    otherwise: list = field(default_factory=list)


@dataclass
class Call:
    """``{{ template "name" pipeline }}``."""

    name: str
    pipeline: Pipeline | None


def _literal(kind: str, text: str) -> Any:
    if kind == "str":
        return json.loads(text)  # Go's escapes in the subset we use match JSON's
    if kind == "raw":
        return text[1:-1]
    return float(text) if "." in text else int(text)


class _PipelineParser:
    def __init__(self, tokens: list[tuple[str, str]], source: str):
        self.tokens, self.source, self.position = tokens, source, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise TemplateError(f"unexpected end of {{{{{self.source}}}}}")
        self.position += 1
        return token

    def pipeline(self) -> Pipeline:
        declare, assign = self._declaration()
        commands = [self._command()]
        while self.peek() and self.peek()[0] == "pipe":
            self.take()
            commands.append(self._command())
        return Pipeline(commands, declare, assign)

    def _declaration(self) -> tuple[list[str], bool]:
        names, start = [], self.position
        while self.peek() and self.peek()[0] == "var" and "." not in self.peek()[1]:
            names.append(self.take()[1])
            token = self.peek()
            if token and token[0] == "comma":
                self.take()
                continue
            if token and token[0] in ("declare", "assign"):
                self.take()
                return names, token[0] == "assign"
            break
        self.position = start
        return [], False

    def _command(self) -> list[Operand]:
        operands = []
        while (token := self.peek()) and token[0] not in ("pipe", "rparen"):
            operands.append(self._operand())
        if not operands:
            raise TemplateError(f"empty command in {{{{{self.source}}}}}")
        return operands

    def _operand(self) -> Operand:
        kind, text = self.take()
        if kind in ("str", "raw", "num"):
            return Operand("literal", _literal(kind, text))
        if kind == "field":
            return Operand("field", [name for name in text.split(".") if name])
        if kind == "var":
            name, *names = text.split(".")
            return Operand("var", (name, names))
        if kind == "ident":
            constants = {"true": True, "false": False, "nil": None}
            if text in constants:
                return Operand("literal", constants[text])
            return Operand("ident", text)
        if kind == "lparen":
            inner = self.pipeline()
            if self.take()[0] != "rparen":
                raise TemplateError(f"unclosed parenthesis in {{{{{self.source}}}}}")
            return Operand("pipeline", inner)
        raise TemplateError(f"unexpected {text!r} in {{{{{self.source}}}}}")


def _parse_pipeline(tokens: list[tuple[str, str]], source: str) -> Pipeline:
    parser = _PipelineParser(tokens, source)
    pipeline = parser.pipeline()
    if parser.peek() is not None:
        raise TemplateError(f"unexpected {parser.peek()[1]!r} in {{{{{source}}}}}")
    return pipeline


def _items(text: str) -> list:
    """Text and actions in order, trimming applied; actions as (keyword, tokens, source)."""
    items: list = []
    position, trim_next = 0, False
    for match in _ACTION.finditer(text):
        before = text[position : match.start()]
        if trim_next:
            before = before.lstrip(" \t\r\n")
        if match.group(1):
            before = before.rstrip(" \t\r\n")
        if before:
            items.append(Text(before))
        position, trim_next = match.end(), bool(match.group(3))
        source = match.group(2).strip()
        if source.startswith("/*"):
            if not source.endswith("*/"):
                raise TemplateError(f"a comment must be the whole action: {{{{{source}}}}}")
            continue
        tokens = _tokens(source)
        keyword = tokens[0][1] if tokens and tokens[0][0] == "ident" else None
        if keyword in _KEYWORDS:
            items.append((keyword, tokens[1:], source))
        else:
            items.append((None, tokens, source))
    rest = text[position:]
    if trim_next:
        rest = rest.lstrip(" \t\r\n")
    if rest:
        items.append(Text(rest))
    return items


class _TreeBuilder:
    def __init__(self, items: list, defines: dict[str, list]):
        self.items, self.position, self.defines = items, 0, defines

    def nodes(self, closers: tuple[str, ...] = ()) -> tuple[list, tuple | None]:
        """Nodes up to one of ``closers`` (returned) or the end of the items."""
        nodes: list = []
        while self.position < len(self.items):
            item = self.items[self.position]
            self.position += 1
            if isinstance(item, Text):
                nodes.append(item)
                continue
            keyword, tokens, source = item
            if keyword in closers:
                return nodes, item
            if keyword is None:
                nodes.append(Action(_parse_pipeline(tokens, source)))
            elif keyword in ("if", "with", "range"):
                nodes.append(self._branch(keyword, tokens, source))
            elif keyword == "define":
                self._define(tokens, source)
            elif keyword == "template":
                nodes.append(self._call(tokens, source))
            else:
                raise TemplateError(f"unexpected {{{{{source}}}}}")
        if closers:
            raise TemplateError(f"unexpected EOF: missing {{{{end}}}} (or one of {closers})")
        return nodes, None

    def _branch(self, keyword: str, tokens: list, source: str) -> Branch:
        branch = Branch(keyword, _parse_pipeline(tokens, source), [])
        branch.body, closer = self.nodes(("else", "end"))
        if closer[0] == "else":
            _else, else_tokens, else_source = closer
            if keyword == "if" and else_tokens[:1] == [("ident", "if")]:
                # `else if` opens an `if` in the else branch that shares this `end`.
                branch.otherwise = [self._branch("if", else_tokens[1:], else_source)]
            elif else_tokens:
                raise TemplateError(f"unsupported {{{{{else_source}}}}}")
            else:
                branch.otherwise, _end = self.nodes(("end",))
        return branch

    def _define(self, tokens: list, source: str) -> None:
        if len(tokens) != 1 or tokens[0][0] != "str":
            raise TemplateError(f"bad {{{{{source}}}}}")
        name = _literal("str", tokens[0][1])
        self.defines[name], _closer = self.nodes(("end",))

    def _call(self, tokens: list, source: str) -> Call:
        if not tokens or tokens[0][0] != "str":
            raise TemplateError(f"bad {{{{{source}}}}}")
        rest = tokens[1:]
        return Call(_literal("str", tokens[0][1]), _parse_pipeline(rest, source) if rest else None)


# --- execution -----------------------------------------------------------------------------


class TemplateSet:
    """Parsed templates by name: each file under its name, and every ``define``."""

    def __init__(self) -> None:
        self.templates: dict[str, list] = {}

    def add(self, name: str, text: str) -> None:
        defines: dict[str, list] = {}
        nodes, _closer = _TreeBuilder(_items(text), defines).nodes()
        self.templates[name] = nodes
        self.templates.update(defines)

    def render(self, name: str, data: Any) -> str:
        if name not in self.templates:
            raise TemplateError(f"no template named {name!r}")
        out: list[str] = []
        _Execution(self).run(self.templates[name], data, [{"$": data}], out)
        return "".join(out)


class _Execution:
    def __init__(self, templates: TemplateSet):
        self.templates = templates

    def run(self, nodes: list, dot: Any, scopes: list[dict], out: list[str]) -> None:
        for node in nodes:
            if isinstance(node, Text):
                out.append(node.text)
            elif isinstance(node, Action):
                value = self.pipeline(node.pipeline, dot, scopes)
                if not node.pipeline.declare:
                    out.append(go_string(value))
            elif isinstance(node, Branch):
                self.branch(node, dot, scopes, out)
            else:
                data = self.pipeline(node.pipeline, dot, scopes) if node.pipeline else None
                out.append(self.templates.render(node.name, data))

    def branch(self, node: Branch, dot: Any, scopes: list[dict], out: list[str]) -> None:
        if node.keyword == "range":
            self.range(node, dot, scopes, out)
            return
        inner = [*scopes, {}]  # variables declared in the condition live in the block
        value = self.pipeline(node.pipeline, dot, inner)
        if truthy(value):
            self.run(node.body, value if node.keyword == "with" else dot, inner, out)
        else:
            self.run(node.otherwise, dot, inner, out)

    def range(self, node: Branch, dot: Any, scopes: list[dict], out: list[str]) -> None:
        value = self.evaluate(node.pipeline.commands, dot, scopes)
        if value is None:
            items = []
        elif isinstance(value, list):
            items = list(enumerate(value))
        elif isinstance(value, dict):
            items = sorted(value.items())  # Go ranges over a map in key order
        else:
            raise TemplateError(f"range over a {go_type(value)}")
        if not items:
            self.run(node.otherwise, dot, [*scopes, {}], out)
        names = node.pipeline.declare
        for key, element in items:
            scope = {names[-1]: element} if names else {}
            if len(names) == 2:
                scope[names[0]] = key
            self.run(node.body, element, [*scopes, scope], out)

    def pipeline(self, pipeline: Pipeline, dot: Any, scopes: list[dict]) -> Any:
        value = self.evaluate(pipeline.commands, dot, scopes)
        for name in pipeline.declare:
            if pipeline.assign:
                self.scope_of(name, scopes)[name] = value
            else:
                scopes[-1][name] = value
        return value

    def evaluate(self, commands: list[list[Operand]], dot: Any, scopes: list[dict]) -> Any:
        piped: list[Any] = []
        for command in commands:
            piped = [self.command(command, dot, scopes, piped)]
        return piped[0]

    def command(self, operands: list[Operand], dot: Any, scopes: list[dict], piped: list) -> Any:
        head, *args = operands
        if head.kind == "ident":
            function = self.function(head.value)
            return function(*(self.operand(arg, dot, scopes) for arg in args), *piped)
        if args or piped:
            raise TemplateError("arguments given to something that is not a function")
        return self.operand(head, dot, scopes)

    def operand(self, operand: Operand, dot: Any, scopes: list[dict]) -> Any:
        if operand.kind == "literal":
            return operand.value
        if operand.kind == "field":
            return self.fields(dot, operand.value)
        if operand.kind == "var":
            name, names = operand.value
            return self.fields(self.scope_of(name, scopes)[name], names)
        if operand.kind == "ident":
            return self.function(operand.value)()
        return self.evaluate(operand.value.commands, dot, scopes)

    @staticmethod
    def scope_of(name: str, scopes: list[dict]) -> dict:
        for scope in reversed(scopes):
            if name in scope:
                return scope
        raise TemplateError(f"undefined variable {name}")

    @staticmethod
    def fields(value: Any, names: list[str]) -> Any:
        for name in names:
            if value is None:
                raise TemplateError(f"nil pointer evaluating .{name}")
            if not isinstance(value, dict):
                raise TemplateError(f"can't evaluate field {name} in a {go_type(value)}")
            value = value.get(name)
        return value

    def function(self, name: str) -> Callable[..., Any]:
        if name == "include":
            return lambda template, data: self.templates.render(template, data)
        if name not in FUNCTIONS:
            raise TemplateError(f"function {name!r} is not supported")
        return FUNCTIONS[name]
