"""Dataclass values as JSON and back, by their fields' declared types."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from loramux.engine.dataclass_json import from_json, to_json


@dataclass(frozen=True)
class Inner:
    name: str
    size: int = 0

    @property
    def double(self) -> int:
        return 2 * self.size


@dataclass(frozen=True)
class Outer:
    inner: Inner
    names: tuple[str, ...]
    pair: tuple[int, float]
    by_name: dict[str, Inner]
    by_tenant: dict[str | None, float]
    by_id: dict[int, str]
    maybe: Inner | None = None
    items: list[Inner] = field(default_factory=list)
    label: str = "x"


VALUE = Outer(
    inner=Inner("a", 1),
    names=("p", "q"),
    pair=(3, 0.5),
    by_name={"b": Inner("b", 2)},
    by_tenant={None: 1.0, "t": 2.5},
    by_id={7: "seven"},
    maybe=Inner("m"),
    items=[Inner("i", 4)],
    label="y",
)


def _through_json(data):
    return json.loads(json.dumps(data))


def test_a_nested_value_round_trips_through_json():
    back = from_json(Outer, _through_json(to_json(VALUE)))
    assert back == VALUE
    assert isinstance(back.names, tuple) and isinstance(back.pair, tuple)
    assert isinstance(back.by_name["b"], Inner) and isinstance(back.items[0], Inner)


def test_fields_go_in_order_and_keys_that_are_not_strings_as_pairs():
    data = to_json(VALUE)
    assert list(data) == list(Outer.__dataclass_fields__)
    assert data["inner"] == {"name": "a", "size": 1}  # properties are not sent
    assert data["names"] == ["p", "q"]
    assert data["by_name"] == {"b": {"name": "b", "size": 2}}
    assert data["by_tenant"] == [[None, 1.0], ["t", 2.5]]
    assert data["by_id"] == [[7, "seven"]]


def test_missing_fields_take_their_defaults_and_unknown_ones_are_dropped():
    data = to_json(VALUE)
    for name in ("maybe", "items", "label"):
        del data[name]
    data["from_a_newer_sender"] = 1
    data["inner"]["also_newer"] = {"x": 1}
    back = from_json(Outer, data)
    assert back == Outer(**{**VALUE.__dict__, "maybe": None, "items": [], "label": "x"})


def test_a_missing_required_field_is_named():
    data = to_json(VALUE)
    del data["names"]
    with pytest.raises(TypeError, match="names"):
        from_json(Outer, data)
