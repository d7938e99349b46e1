import subprocess
import sys

import pytest

from loramux.engine.structured import (
    GrammarError,
    JsonObject,
    JsonSchema,
    Regex,
    Tool,
    ToolCalls,
    ToolChoice,
    spec_from_json,
    spec_key,
    spec_to_json,
)
from loramux.engine.structured.spec import MAX_SPEC_CHARS

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})


@pytest.mark.parametrize(
    "spec",
    [
        JsonObject(),
        JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=False),
        Regex(r"[0-9]{3}-[a-z]+"),
        ToolCalls((WEATHER, Tool("noop")), ToolChoice.REQUIRED, parallel=False),
        ToolCalls((WEATHER,), ToolChoice.NAMED, function="get_weather"),
    ],
)
def test_specs_round_trip_the_wire_and_keep_their_key(spec):
    back = spec_from_json(spec_to_json(spec))
    assert back == spec
    assert spec_key(back) == spec_key(spec)
    assert hash(back) == hash(spec)


def test_the_key_keeps_property_order_since_the_output_follows_it():
    ab = JsonSchema({"properties": {"a": {}, "b": {}}})
    ba = JsonSchema({"properties": {"b": {}, "a": {}}})
    assert spec_key(ab) != spec_key(ba)
    assert spec_key(ab) == spec_key(JsonSchema({"properties": {"a": {}, "b": {}}}))


def test_a_schema_is_copied_so_the_callers_dict_may_change():
    schema = {"type": "object", "properties": {}}
    spec = JsonSchema(schema)
    schema["properties"]["x"] = {"type": "string"}
    assert spec.schema == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: JsonSchema(["not", "an", "object"]), "must be a JSON schema object"),
        (lambda: JsonSchema({"x": float("nan")}), "is not JSON"),
        (lambda: JsonSchema({"x": object()}), "is not JSON"),
        (lambda: JsonSchema({"d": "x" * MAX_SPEC_CHARS}), "characters long"),
        (lambda: JsonSchema({}, strict="yes"), "strict must be a bool"),
        (lambda: Regex(""), "non-empty string"),
        (lambda: Tool("has space"), "tool name"),
        (lambda: ToolCalls(()), "non-empty list"),
        (lambda: ToolCalls((WEATHER, WEATHER)), "repeated: get_weather"),
        (lambda: ToolCalls((WEATHER,), ToolChoice.NAMED, function="other"), "'other'"),
        (lambda: ToolCalls((WEATHER,), ToolChoice.AUTO, function="get_weather"), "only for"),
        (lambda: spec_from_json({"type": "grammar"}), "unknown structured-output type"),
        (lambda: spec_from_json({"type": "json_schema"}), "malformed"),
        (lambda: spec_from_json({"type": "tool_calls", "tools": []}), "non-empty"),
        (
            lambda: spec_from_json({"type": "tool_calls", "tools": [{"name": "f"}], "choice": "x"}),
            "one of auto, required, named, got 'x'",
        ),
    ],
)
def test_malformed_specs_raise_grammar_error_naming_the_field(make, message):
    with pytest.raises(GrammarError, match=message.replace("(", r"\(")):
        make()


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "integer", "minimum": 2**70}, "/minimum"),
        ({"type": "integer", "maximum": -(2**70)}, "/maximum"),
        ({"type": "array", "maxItems": 2**64}, "/maxItems"),
        ({"const": 2**53 + 1}, "/const"),  # the compiler would enforce 2**53 instead
        ({"type": "integer", "enum": [1, -1e19]}, "/enum/1"),  # crashed the library's process
        ({"type": "integer", "const": -(2**63)}, "/const"),  # crashed it too
        ({"properties": {"a/b~": {"default": 10**30}}}, "/properties/a~1b~0/default"),
    ],
)
def test_a_number_past_2_53_anywhere_in_a_schema_is_refused_naming_it(schema, pointer):
    for make in (lambda: JsonSchema(schema), lambda: Tool("f", schema)):
        with pytest.raises(GrammarError, match=f"^{pointer} is .* within -9007199254740991 to"):
            make()


def test_numbers_up_to_2_53_are_taken_and_compile():
    from loramux.engine.structured import check_spec

    top = 2**53 - 1
    for schema in (
        {"type": "integer", "minimum": -top, "maximum": top},
        {"type": "integer", "enum": [-top, top, float(-top)]},
        {"const": -top},
        {"type": "array", "maxItems": top},
        {"type": "boolean", "default": True},  # a bool is not a number, whatever Python says
    ):
        check_spec(JsonSchema(schema, strict=True))


def test_grammar_error_is_a_value_error():
    assert issubclass(GrammarError, ValueError)


def test_specs_parsing_and_masking_work_without_the_grammar_library():
    # A machine that installs loramux with --no-deps (a lent GPU) may lack llguidance: only
    # compiling needs it, so the engine still imports and serves unconstrained requests.
    code = """
import sys
sys.modules["llguidance"] = None  # any import of it now fails
import torch
from loramux.engine.structured import JsonSchema, apply_token_bitmask, parse_tool_output
from loramux.engine.structured import spec_from_json, spec_to_json
spec = JsonSchema({"type": "object"})
assert spec_from_json(spec_to_json(spec)) == spec
assert parse_tool_output("hi").content == "hi"
apply_token_bitmask(torch.zeros(1, 32), torch.full((1, 1), -1, dtype=torch.int32))
try:
    from loramux.engine.structured import check_spec
    check_spec(spec)
except ImportError:
    print("compile needs llguidance")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "compile needs llguidance"
