"""``adapter_config.json``, parsed once and strictly into an :class:`AdapterConfig`.

The file comes from tenants, so every field the engine uses has its type and range
checked, and any way the JSON can be broken (NaN or Infinity literals, numbers beyond a
double, 5,000-digit integers, nesting thousands deep, pattern keys that would backtrack
exponentially) ends as an :class:`AdapterError` naming the problem.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``;
``rank_pattern`` / ``alpha_pattern`` override them per module, the first key matching the
module's name (``model.layers.3.self_attn.q_proj``) as the regex ``(.*\\.)?(key)$`` wins.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from re import _constants as regex_ops
from re import _parser as regex_parser

CONFIG_FILE = "adapter_config.json"

# Bounds on adapter_config.json. PEFT writes ~1 KB; a per-module rank_pattern for an
# 80-layer model (560 keys) is ~40 KB.
MAX_CONFIG_BYTES = 1 << 20
MAX_INT_DIGITS = 30  # any honest integer in a config is far shorter
MAX_RANK = 1 << 16  # no base model's hidden size comes near it
# lora_alpha (and alpha_pattern values) lie in (0, MAX_LORA_ALPHA]: honest alphas are
# 1-1024; zero makes the adapter a no-op and a negative one flips it, neither of which a
# trained adapter does. Whether the resulting scale fits the serving dtype is checked
# against the weights when they are loaded.
MAX_LORA_ALPHA = 1e6
DEFAULT_LORA_ALPHA = 8  # PEFT's LoraConfig default
# Pattern keys are regexes matched against every module name: bounded in number and
# length, and free of nested loops, so matching cannot take exponential time.
MAX_PATTERN_KEYS = 1024
MAX_PATTERN_KEY_CHARS = 256
MAX_PATTERN_KEY_LOOPS = 2


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _show(value: object) -> str:
    """A value for an error message, cut short: tenants' values can be megabytes."""
    return _SHORT.repr(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_rank(value: object, where: str) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RANK):
        raise AdapterError(
            f"{CONFIG_FILE}: {where} must be an integer from 1 to {MAX_RANK}, got {_show(value)}"
        )
    return value


def _check_alpha(value: object, where: str) -> float:
    # The comparisons refuse NaN and infinities too.
    if not (_is_number(value) and 0 < value <= MAX_LORA_ALPHA):
        raise AdapterError(
            f"{CONFIG_FILE}: {where} must be a number above 0 and at most {MAX_LORA_ALPHA:.0f}, "
            f"got {_show(value)}"
        )
    return float(value)


def _loops(parsed, where: str, inside_loop: bool = False) -> int:
    """How many loops (repeats that may run more than once) a parsed regex holds.

    A loop whose body can match in more than one way (it holds a repeat, even ``?``, or an
    alternation) can backtrack exponentially (``(a+)+``, ``(.|.)*``, ``(a?a?)*``): refused,
    since the loader matches every module name against every key.
    """
    loops = 0
    for op, arg in parsed:
        if op in (regex_ops.MAX_REPEAT, regex_ops.MIN_REPEAT, regex_ops.POSSESSIVE_REPEAT):
            _, most, body = arg
            is_loop = most > 1
            if inside_loop:
                raise AdapterError(
                    f"{CONFIG_FILE}: {where} repeats inside a repeat, which can take "
                    f"exponential time to match; use module names or a simpler regex"
                )
            loops += is_loop + _loops(body, where, inside_loop or is_loop)
        elif op == regex_ops.BRANCH:
            if inside_loop:
                raise AdapterError(
                    f"{CONFIG_FILE}: {where} repeats an alternation, which can take "
                    f"exponential time to match; use module names or a simpler regex"
                )
            loops += sum(_loops(branch, where, inside_loop) for branch in arg[1])
        elif op == regex_ops.SUBPATTERN:
            loops += _loops(arg[3], where, inside_loop)
        elif op in (regex_ops.ASSERT, regex_ops.ASSERT_NOT):
            loops += _loops(arg[1], where, inside_loop)
        elif op == regex_ops.ATOMIC_GROUP:
            loops += _loops(arg, where, inside_loop)
        elif op == regex_ops.GROUPREF_EXISTS:
            loops += sum(_loops(part, where, inside_loop) for part in arg[1:] if part is not None)
    return loops


def _compile_pattern_key(key: object, name: str) -> re.Pattern[str]:
    """PEFT's regex for a pattern key: ``(.*\\.)?(key)$``, matched from the name's start."""
    if not isinstance(key, str) or not key:
        raise AdapterError(f"{CONFIG_FILE}: {name} keys must be non-empty strings")
    if len(key) > MAX_PATTERN_KEY_CHARS:
        raise AdapterError(
            f"{CONFIG_FILE}: {name} key {_show(key)} is {len(key)} characters, above "
            f"{MAX_PATTERN_KEY_CHARS}"
        )
    try:
        parsed = regex_parser.parse(key)
        compiled = re.compile(rf"(.*\.)?({key})$")
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterError(
            f"{CONFIG_FILE}: {name} key {_show(key)} is not a valid regex: {exc}"
        ) from exc
    if _loops(parsed, f"{name} key {_show(key)}") > MAX_PATTERN_KEY_LOOPS:
        raise AdapterError(
            f"{CONFIG_FILE}: {name} key {_show(key)} has more than {MAX_PATTERN_KEY_LOOPS} "
            f"repeats; use module names or a simpler regex"
        )
    return compiled


@dataclass(frozen=True)
class ModulePattern:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the first key matching a module wins."""

    entries: tuple[tuple[str, re.Pattern[str], int | float], ...] = ()  # (key, PEFT's regex, value)

    @classmethod
    def parse(cls, raw: object, name: str, check_value) -> ModulePattern:
        """From the JSON value of field ``name``; ``check_value(value, where)`` checks each."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise AdapterError(
                f"{CONFIG_FILE}: {name} must be an object of module name -> value, got {_show(raw)}"
            )
        if len(raw) > MAX_PATTERN_KEYS:
            raise AdapterError(
                f"{CONFIG_FILE}: {name} has {len(raw)} keys, above {MAX_PATTERN_KEYS}"
            )
        entries = []
        for key, value in raw.items():
            regex = _compile_pattern_key(key, name)
            entries.append((key, regex, check_value(value, f"{name}[{_show(key)}]")))
        return cls(tuple(entries))

    def value_for(self, module_name: str, default):
        for _, regex, value in self.entries:
            if regex.match(module_name):
                return value
        return default

    def values(self) -> list[tuple[str, int | float]]:
        """(key, value) pairs in the config's order."""
        return [(key, value) for key, _, value in self.entries]


def _check_supported(raw: dict) -> None:
    """Refuse adapter kinds the engine does not implement."""
    peft_type = raw.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(f"peft_type {_show(peft_type)} is not supported (only LORA)")
    parameters = raw.get("target_parameters") or []
    if not isinstance(parameters, list) or any(
        not isinstance(name, str) or name.rsplit(".", 1)[-1] not in ("gate_up_proj", "down_proj")
        for name in parameters
    ):
        raise AdapterError(
            f"target_parameters ({_show(parameters)}) may name only a mixture-of-experts "
            "model's stacked experts, gate_up_proj and down_proj (experts.gate_up_proj, ...); "
            "target other weights by module (target_modules)"
        )
    if raw.get("bias", "none") != "none":
        raise AdapterError(
            f"adapters with bias={_show(raw['bias'])} retrain the base model's own biases, "
            'which are not served per adapter; train with bias: "none" (lora_bias: true gives '
            "LoRA a bias of its own, which is served)"
        )


# What modules_to_save and trainable_token_indices may name, as PEFT writes them, and the
# module each stands for: the rows of the embedding or of the LM head an adapter replaces.
TOKEN_MODULES = {
    "embed_tokens": "embed_tokens",
    "model.embed_tokens": "embed_tokens",
    "lm_head": "lm_head",
}
MAX_TOKEN_INDEX = (1 << 31) - 1


def _token_module(name: object, field: str) -> str:
    if not isinstance(name, str) or name not in TOKEN_MODULES:
        raise AdapterError(
            f"{CONFIG_FILE}: {field} names {_show(name)}; only the embedding (embed_tokens) "
            "and the LM head (lm_head) can be served from it: train the rest with LoRA "
            "(target_modules)"
        )
    return TOKEN_MODULES[name]


def _parse_modules_to_save(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise AdapterError(
            f"{CONFIG_FILE}: modules_to_save must be a list of module names, got {_show(raw)}"
        )
    return tuple(sorted({_token_module(name, "modules_to_save") for name in raw}))


def _parse_token_indices(raw: object) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """PEFT's trainable_token_indices: a list (the embedding's) or module -> list."""
    if raw is None:
        return ()
    per_module = raw if isinstance(raw, dict) else {"embed_tokens": raw}
    parsed = {}
    for name, indices in per_module.items():
        module = _token_module(name, "trainable_token_indices")
        where = (
            f"trainable_token_indices[{_show(name)}]"
            if isinstance(raw, dict)
            else ("trainable_token_indices")
        )
        if not (
            isinstance(indices, list)
            and indices
            and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_INDEX
                for i in indices
            )
        ):
            raise AdapterError(
                f"{CONFIG_FILE}: {where} must be a non-empty list of token ids, got {_show(indices)}"
            )
        if len(set(indices)) != len(indices) or module in parsed:
            raise AdapterError(f"{CONFIG_FILE}: {where} names a token more than once")
        parsed[module] = tuple(indices)
    return tuple(sorted(parsed.items()))


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` loramux uses, checked (see ``parse``)."""

    r: int | None = None  # None: each module's rank is its tensors' rank
    lora_alpha: float = DEFAULT_LORA_ALPHA
    use_rslora: bool = False
    use_dora: bool = False  # each module also has a magnitude vector (``engine/lora/dora.py``)
    lora_bias: bool = False  # each module's B has a bias (``engine/lora/output_terms.py``)
    # whole embedding / LM head tables it replaces ("embed_tokens", "lm_head")
    modules_to_save: tuple[str, ...] = ()
    # (module, token ids) whose rows it replaces (PEFT's trainable_token_indices), by module
    trainable_tokens: tuple[tuple[str, tuple[int, ...]], ...] = ()
    target_modules: tuple[str, ...] | str | None = None  # a str is a regex or "all-linear"
    rank_pattern: ModulePattern = ModulePattern()
    alpha_pattern: ModulePattern = ModulePattern()
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        if self.r is not None:
            _check_rank(self.r, "r")
        _check_alpha(self.lora_alpha, "lora_alpha")
        if not isinstance(self.use_rslora, bool):
            raise AdapterError(
                f"{CONFIG_FILE}: use_rslora must be true or false, got {_show(self.use_rslora)}"
            )
        for flag in ("use_dora", "lora_bias"):
            if not isinstance(getattr(self, flag), bool):
                raise AdapterError(
                    f"{CONFIG_FILE}: {flag} must be true or false, got {_show(getattr(self, flag))}"
                )
        if self.use_dora and self.lora_bias:
            raise AdapterError(
                f"{CONFIG_FILE}: use_dora and lora_bias are both true, which PEFT does not "
                "train together; train with one of them"
            )
        targets = self.target_modules
        if not (
            targets is None
            or isinstance(targets, str)
            or (isinstance(targets, tuple) and all(isinstance(t, str) for t in targets))
        ):
            raise AdapterError(
                f"{CONFIG_FILE}: target_modules must be a list of module names or a string, "
                f"got {_show(targets)}"
            )
        trained_on = self.base_model_name_or_path
        if trained_on is not None and not isinstance(trained_on, str):
            raise AdapterError(f"{CONFIG_FILE}: base_model_name_or_path must be a string")

    @classmethod
    def parse(cls, raw: object) -> AdapterConfig:
        """From the decoded JSON; ``AdapterError`` naming the field if anything is off."""
        if not isinstance(raw, dict):
            raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
        _check_supported(raw)
        targets = raw.get("target_modules")
        return cls(
            r=raw.get("r"),
            lora_alpha=raw.get("lora_alpha", DEFAULT_LORA_ALPHA),
            use_rslora=raw.get("use_rslora", False),
            use_dora=raw.get("use_dora", False),
            lora_bias=raw.get("lora_bias", False),
            modules_to_save=_parse_modules_to_save(raw.get("modules_to_save")),
            trainable_tokens=_parse_token_indices(raw.get("trainable_token_indices")),
            target_modules=tuple(targets) if isinstance(targets, list) else targets,
            rank_pattern=ModulePattern.parse(raw.get("rank_pattern"), "rank_pattern", _check_rank),
            alpha_pattern=ModulePattern.parse(
                raw.get("alpha_pattern"), "alpha_pattern", _check_alpha
            ),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
        )

    def rank_for(self, module_name: str) -> int | None:
        """The rank the config gives a module (None: whatever its tensors have)."""
        return self.rank_pattern.value_for(module_name, self.r)

    def scale_for(self, module_name: str, rank: int) -> float:
        alpha = self.alpha_pattern.value_for(module_name, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass(frozen=True)
class _UnusableNumber:
    """A JSON number no field can hold: NaN, ±Infinity, beyond a double, or too many digits.

    Parsed into this marker rather than refused on sight, so that the refusal names the
    field holding it (fields loramux does not read may hold anything).
    """

    text: str

    def __repr__(self) -> str:
        if len(self.text) <= 24:
            return self.text
        return f"{self.text[:12]}... (a number of {len(self.text)} characters)"


def _finite_float(text: str) -> float | _UnusableNumber:
    value = float(text)
    return value if math.isfinite(value) else _UnusableNumber(text)  # 1e400 parses as inf


def _short_int(text: str) -> int | _UnusableNumber:
    # Past Python's 4,300-digit limit int() raises; far short of it, no field wants it.
    return int(text) if len(text) <= MAX_INT_DIGITS else _UnusableNumber(text)


def parse_adapter_config(data: bytes) -> AdapterConfig:
    """The checked config from the bytes of ``adapter_config.json``."""
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is {len(data)} bytes, above {MAX_CONFIG_BYTES}")
    try:
        raw = json.loads(
            data.decode("utf-8"),
            parse_constant=_UnusableNumber,  # NaN, Infinity, -Infinity
            parse_float=_finite_float,
            parse_int=_short_int,
        )
    except RecursionError as exc:
        raise AdapterError(f"{CONFIG_FILE} is nested too deeply to parse") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    return AdapterConfig.parse(raw)


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing from {adapter_dir}")
    if path.stat().st_size > MAX_CONFIG_BYTES:  # before reading it
        raise AdapterError(
            f"{CONFIG_FILE} is {path.stat().st_size} bytes, above {MAX_CONFIG_BYTES}"
        )
    return parse_adapter_config(path.read_bytes())
