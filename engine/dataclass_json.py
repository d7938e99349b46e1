"""Dataclass values as JSON and back, driven by their fields' declared types.

Encoding (:func:`to_json`): a dataclass becomes an object of its fields in declaration order
(properties are not sent: the other side computes them from the fields); a tuple or list
becomes a list; a dict whose keys are declared ``str`` becomes an object, any other dict
(keys that may be ``None``, or numbers) a list of ``[key, value]`` pairs, since JSON object
keys are strings; anything else travels as it is.

Decoding (:func:`from_json`) rebuilds the declared types, nested dataclasses included. A
field the data lacks takes its default (data from an older sender), a key the class does
not declare is dropped (a newer sender's), and a required field that is missing raises
``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _optional_arm(hint: Any) -> Any:
    """``X`` for ``X | None``; any other hint as it is."""
    if _is_union(hint):
        arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return hint


def _item_hints(hint: Any, length: int) -> list[Any]:
    """The declared type of each item of a tuple or list of ``length`` items."""
    args = typing.get_args(hint)
    if not args:
        return [Any] * length
    if typing.get_origin(hint) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return list(args)  # a fixed tuple: one type per position
    return [args[0]] * length


def _key_value_hints(hint: Any) -> tuple[Any, Any]:
    args = typing.get_args(hint)
    return (args[0], args[1]) if args else (str, Any)


def to_json(value: Any) -> dict[str, Any]:
    """A dataclass value as a JSON-ready dict (see the module's docstring)."""
    hints = _hints(type(value))
    return {
        f.name: _encode(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)
    }


def _encode(value: Any, hint: Any) -> Any:
    hint = _optional_arm(hint)
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(v, h) for v, h in zip(value, _item_hints(hint, len(value)), strict=True)]
    if isinstance(value, dict):
        key_hint, value_hint = _key_value_hints(hint)
        if key_hint is str:
            return {k: _encode(v, value_hint) for k, v in value.items()}
        return [[_encode(k, key_hint), _encode(v, value_hint)] for k, v in value.items()]
    return value


def from_json(cls: type[T], data: dict[str, Any]) -> T:
    """The ``cls`` value :func:`to_json` gave ``data`` for (see the module's docstring)."""
    hints = _hints(cls)
    return cls(
        **{
            f.name: _decode(data[f.name], hints[f.name])
            for f in dataclasses.fields(cls)
            if f.init and f.name in data
        }
    )


def _decode(value: Any, hint: Any) -> Any:
    hint = _optional_arm(hint)
    if value is None:
        return None
    origin = typing.get_origin(hint) or hint
    if dataclasses.is_dataclass(origin):
        return from_json(origin, value)
    if origin in (tuple, list):
        items = [_decode(v, h) for v, h in zip(value, _item_hints(hint, len(value)), strict=True)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_hint, value_hint = _key_value_hints(hint)
        pairs = value.items() if isinstance(value, dict) else value
        return {_decode(k, key_hint): _decode(v, value_hint) for k, v in pairs}
    return value
