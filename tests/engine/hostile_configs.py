"""``adapter_config.json`` as a hostile tenant writes it, for the engine's and ingest's tests.

Each case edits an honest PEFT config (a dict) into the bytes of a bad one, and gives a
regex the refusal must match: the field at fault and what was wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

WriteConfig = Callable[[dict], bytes]
_RAW = "@@raw-value@@"


def changed(**changes) -> WriteConfig:
    """The config with ``changes`` (Python's json writes inf and nan as Infinity and NaN)."""
    return lambda config: json.dumps({**config, **changes}).encode()


def raw(field: str, text: str) -> WriteConfig:
    """The config with ``field`` set to ``text`` verbatim: numbers json.dumps cannot write."""
    return lambda config: json.dumps({**config, field: _RAW}).replace(f'"{_RAW}"', text).encode()


def nested(depth: int) -> WriteConfig:
    """The config with an extra field nested ``depth`` lists deep."""
    return lambda config: (
        json.dumps({**config, "extra": _RAW})
        .replace(f'"{_RAW}"', "[" * depth + "]" * depth)
        .encode()
    )


ALPHA_RANGE = "lora_alpha must be a number above 0 and at most 1000000, got"
HOSTILE_CONFIGS: dict[str, tuple[WriteConfig, str]] = {
    "alpha-1e308": (changed(lora_alpha=1e308), rf"{ALPHA_RANGE} 1e\+308"),
    "alpha-Infinity": (changed(lora_alpha=float("inf")), f"{ALPHA_RANGE} Infinity"),
    "alpha-NaN": (changed(lora_alpha=float("nan")), f"{ALPHA_RANGE} NaN"),
    "alpha-1e400": (raw("lora_alpha", "1e400"), f"{ALPHA_RANGE} 1e400"),
    "alpha-negative": (changed(lora_alpha=-1e30), rf"{ALPHA_RANGE} -1e\+30"),
    "alpha-zero": (changed(lora_alpha=0), f"{ALPHA_RANGE} 0"),
    "alpha-null": (changed(lora_alpha=None), f"{ALPHA_RANGE} None"),
    "alpha-string": (changed(lora_alpha="8"), f"{ALPHA_RANGE} '8'"),
    "alpha-list": (changed(lora_alpha=[8]), rf"{ALPHA_RANGE} \[8\]"),
    "alpha-bool": (changed(lora_alpha=True), f"{ALPHA_RANGE} True"),
    "r-5000-digits": (
        raw("r", "7" * 5000),
        r": r must be an integer from 1 to 65536, got 7+\.\.\. \(a number of 5000 characters\)",
    ),
    "r-zero": (changed(r=0), ": r must be an integer from 1 to 65536, got 0"),
    "r-float": (changed(r=8.0), r": r must be an integer from 1 to 65536, got 8\.0"),
    "rslora-string": (changed(use_rslora="false"), "use_rslora must be true or false, got 'false'"),
    "rslora-null": (changed(use_rslora=None), "use_rslora must be true or false, got None"),
    "dora-string": (changed(use_dora="false"), "use_dora must be true or false, got 'false'"),
    "lora-bias-string": (changed(lora_bias=1), "lora_bias must be true or false, got 1"),
    "modules-to-save-string": (
        changed(modules_to_save="lm_head"),
        "modules_to_save must be a list of module names, got 'lm_head'",
    ),
    "token-indices-negative": (
        changed(trainable_token_indices=[-1]),
        r"trainable_token_indices must be a non-empty list of token ids, got \[-1\]",
    ),
    "targets-object": (
        changed(target_modules={}),
        "target_modules must be a list of module names or a string, got {}",
    ),
    "targets-numbers": (changed(target_modules=[1, 2]), "target_modules must be a list"),
    "rank-pattern-list": (
        changed(rank_pattern=[["q_proj", 4]]),
        "rank_pattern must be an object of module name -> value",
    ),
    "alpha-pattern-string": (
        changed(alpha_pattern="q_proj"),
        "alpha_pattern must be an object of module name -> value",
    ),
    "rank-pattern-bad-regex": (
        changed(rank_pattern={"(": 4}),
        r"rank_pattern key '\(' is not a valid regex",
    ),
    "alpha-pattern-bad-regex": (
        changed(alpha_pattern={"q_proj[": 4}),
        r"alpha_pattern key 'q_proj\[' is not a valid regex",
    ),
    "rank-pattern-exponential-regex": (
        changed(rank_pattern={"(a+)+q_proj": 4}),
        r"rank_pattern key '\(a\+\)\+q_proj' repeats inside a repeat",
    ),
    "rank-pattern-text-value": (
        changed(rank_pattern={"q_proj": "4"}),
        r"rank_pattern\['q_proj'\] must be an integer from 1 to 65536, got '4'",
    ),
    "alpha-pattern-text-value": (
        changed(alpha_pattern={"q_proj": "16"}),
        r"alpha_pattern\['q_proj'\] must be a number above 0 and at most 1000000, got '16'",
    ),
    "alpha-pattern-1e308": (
        changed(alpha_pattern={"v_proj": 1e308}),
        r"alpha_pattern\['v_proj'\] must be a number above 0 and at most 1000000, got 1e\+308",
    ),
    "nested-5000-deep": (nested(5000), "adapter_config.json is nested too deeply to parse"),
}
