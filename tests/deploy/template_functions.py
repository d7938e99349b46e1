"""Go's printing of values and the Helm/Sprig functions the loramux chart uses, with Helm's
semantics (numbers from values are float64; ``quote``, ``default``, ``required``...)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import yaml


class TemplateError(Exception):
    """The template is malformed, uses something unsupported, or failed (``required``)."""


# --- values as Go prints them --------------------------------------------------------------


def go_float(number: float) -> str:
    """``fmt.Sprint`` of a float64: its shortest digits, in exponent form when the exponent
    is below -4 or 6 and above (``8100``, ``1.25``, ``1e+06``, ``1.7179869184e+10``)."""
    if number != number:
        return "NaN"
    if number in (float("inf"), float("-inf")):
        return "+Inf" if number > 0 else "-Inf"
    if number == 0:
        return "0"
    shortest = Decimal(repr(number)).normalize()
    sign, digits, exponent = shortest.as_tuple()
    power = len(digits) + exponent - 1  # of the leading digit
    if -4 <= power < 6:
        return format(shortest, "f")
    mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{'-' if power < 0 else '+'}{abs(power):02d}"


def go_type(value: Any) -> str:
    """The Go type name a value has once Helm loaded it (for printf's bad-verb output)."""
    names = {bool: "bool", int: "int64", float: "float64", str: "string"}
    return (
        "<nil>"
        if value is None
        else names.get(type(value), "map" if isinstance(value, dict) else "slice")
    )


def go_string(value: Any) -> str:
    """How an action prints a value; Helm prints a missing one as nothing."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return value
    raise TemplateError(f"printing a {go_type(value)} is not supported (use toYaml)")


def truthy(value: Any) -> bool:
    """Go's truth: false, 0, nil and empty strings, lists and maps are false."""
    return bool(value)


# --- Helm's and Sprig's functions (the ones the chart uses) --------------------------------


def _to_int64(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return int(value)  # float64 -> int64 truncates, as Go's conversion does
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return 0
    return 0


def _to_yaml(value: Any) -> str:
    """sigs.k8s.io/yaml's output as PyYAML writes it: sorted keys, whole floats as integers
    (their JSON form), no trailing newline."""

    def plain(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: plain(item) for key, item in node.items()}
        if isinstance(node, list):
            return [plain(item) for item in node]
        if isinstance(node, float) and node.is_integer():
            return int(node)
        return node

    dumped = yaml.safe_dump(plain(value), sort_keys=True, default_flow_style=False)
    return dumped.removesuffix("\n").removesuffix("...").removesuffix("\n")


def _indent(width: int, text: str) -> str:
    pad = " " * _to_int64(width)
    return pad + text.replace("\n", "\n" + pad)


def _printf(template: str, *args: Any) -> str:
    """Go's Sprintf for %s, %d, %v, %q and %%, with Go's output for a mismatched verb."""
    remaining = list(args)

    def verb(match: re.Match) -> str:
        letter = match.group(1)
        if letter == "%":
            return "%"
        if not remaining:
            return f"%!{letter}(MISSING)"
        value = remaining.pop(0)
        if letter == "d" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if letter == "s" and isinstance(value, str):
            return value
        if letter == "q" and isinstance(value, str):
            return json.dumps(value, ensure_ascii=False)
        if letter == "v":
            return go_string(value)
        return f"%!{letter}({go_type(value)}={go_string(value)})"

    out = re.sub(r"%([%sdvq])", verb, template)
    if remaining:
        raise TemplateError(f"printf {template!r}: extra arguments {remaining!r}")
    return out


def _print(*args: Any) -> str:
    """Go's Sprint: a space between two operands when neither is a string."""
    out = ""
    for index, value in enumerate(args):
        if index and not isinstance(value, str) and not isinstance(args[index - 1], str):
            out += " "
        out += go_string(value)
    return out


def _required(message: str, value: Any) -> Any:
    if value is None or value == "":
        raise TemplateError(message)
    return value


def _fail(message: str) -> None:
    raise TemplateError(message)


def _default(fallback: Any, *given: Any) -> Any:
    return given[0] if given and truthy(given[0]) else fallback


def _trunc(length: Any, text: str) -> str:
    length = _to_int64(length)
    return text[:length] if length >= 0 else text[length:]


def _div(a: Any, b: Any) -> int:
    a, b = _to_int64(a), _to_int64(b)
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


def _dict(*pairs: Any) -> dict:
    if len(pairs) % 2:
        raise TemplateError("dict needs key-value pairs")
    return {go_string(pairs[i]): pairs[i + 1] for i in range(0, len(pairs), 2)}


def _and(*args: Any) -> Any:
    for value in args:
        if not truthy(value):
            return value
    return args[-1]


def _or(*args: Any) -> Any:
    for value in args:
        if truthy(value):
            return value
    return args[-1]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quote": lambda *args: " ".join(
        json.dumps(go_string(value), ensure_ascii=False) for value in args if value is not None
    ),
    "default": _default,
    "empty": lambda value: not truthy(value),
    "required": _required,
    "fail": _fail,
    "toYaml": _to_yaml,
    "toString": go_string,
    "indent": _indent,
    "nindent": lambda width, text: "\n" + _indent(width, text),
    "trunc": _trunc,
    "trim": lambda text: text.strip(),
    "trimSuffix": lambda suffix, text: text.removesuffix(suffix),
    "trimPrefix": lambda prefix, text: text.removeprefix(prefix),
    "contains": lambda part, text: part in text,
    "printf": _printf,
    "print": _print,
    "int": _to_int64,
    "int64": _to_int64,
    "div": _div,
    "sha256sum": lambda text: hashlib.sha256(text.encode()).hexdigest(),
    "dict": _dict,
    "list": lambda *items: list(items),
    "not": lambda value: not truthy(value),
    "and": _and,
    "or": _or,
    "eq": lambda value, *others: any(value == other for other in others),
    "ne": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
}
