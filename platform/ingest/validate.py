"""Validating an uploaded PEFT adapter folder against the base model before it is stored.

Cheap checks come first and nothing is unpickled, ever: a pickle file in the folder is
refused unopened. The safetensors header (an 8-byte little-endian length, then JSON) is
parsed here, bounded, before any tensor is read; every tensor must be a float LoRA A/B
weight (or a DoRA magnitude vector) of a module the base model has, in one of its layers,
with the base model's shapes and a rank within the limit, or rows of the embedding or LM
head (modules_to_save, trainable_token_indices). ``adapter_config.json`` goes through the engine's own
strict parse (``AdapterConfig``), so the two can never disagree about what it says. Only
then is the engine's loader run over the folder: it reads the values (refusing NaN and
infinities) and makes the full semantic check, so an adapter accepted here is one the
engine will load.

The platform does not know which dtype an engine serves in (a remote engine may run on
any device), so the loader runs in float16, the strictest: an adapter is accepted only if
its A, B, scales and scale·B all stay finite within fp16's ±65504 (bf16 and fp32 reach
further). Every refusal is an ``UploadRejected`` whose message is for the uploader.
Digests are not computed here: the object store hashes the files as it stores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.engine import (
    CONFIG_FILE,
    LORA_TARGETS,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    ModelConfig,
    load_adapter,
    parse_expert_tensor_name,
    parse_lora_tensor_name,
    parse_token_tensor_name,
    read_adapter_config,
)
from loramux.platform.ingest.archive import PICKLE_SUFFIXES
from loramux.platform.ingest.errors import UploadRejected

MAX_HEADER_BYTES = 8 << 20  # a 70B model's all-module adapter header is ~200 KB
# The dtype with the smallest range an engine may serve in: what is finite there is
# finite in bfloat16 and float32 too.
STRICTEST_SERVING_DTYPE = torch.float16

# safetensors dtype code -> (name reported in AdapterInfo, bytes per element)
FLOAT_DTYPES = {
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
}


@dataclass(frozen=True)
class AdapterInfo:
    """What ingest learned about an accepted adapter."""

    rank: int  # the largest rank over its modules
    target_modules: list[str]  # sorted short names, e.g. ["q_proj", "v_proj"]
    size_bytes: int  # adapter_config.json + adapter_model.safetensors
    dtype: str  # "float32", "float16", "bfloat16" or "float64"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the safetensors header describes it."""

    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    start: int  # byte offsets into the data section
    end: int


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise UploadRejected(f"{WEIGHTS_FILE} header names {key!r} twice")
        result[key] = value
    return result


def _entry(name: str, raw: object) -> TensorEntry:
    if not isinstance(raw, dict):
        raise UploadRejected(f"{WEIGHTS_FILE}: header entry for tensor {name!r} is malformed")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(dtype, str):
        raise UploadRejected(f"{WEIGHTS_FILE}: tensor {name!r} has no dtype")
    if dtype not in FLOAT_DTYPES:
        raise UploadRejected(
            f"{WEIGHTS_FILE}: tensor {name!r} has dtype {dtype}; LoRA weights must be a "
            f"float type ({', '.join(FLOAT_DTYPES)})"
        )

    def is_count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise UploadRejected(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
        raise UploadRejected(f"{WEIGHTS_FILE}: tensor {name!r} has malformed data_offsets")
    start, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    if end - start != numel * FLOAT_DTYPES[dtype][1]:
        raise UploadRejected(
            f"{WEIGHTS_FILE}: tensor {name!r} has data_offsets [{start}, {end}] that do not "
            f"match its shape {shape} and dtype {dtype}"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), start=start, end=end)


def read_safetensors_header(
    path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES
) -> list[TensorEntry]:
    """The tensors a safetensors file declares, parsed and bounds-checked, data unread."""
    file_bytes = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise UploadRejected(f"{WEIGHTS_FILE} is too short to be a safetensors file")
        header_bytes = int.from_bytes(prefix, "little")
        if header_bytes > max_header_bytes:
            raise UploadRejected(
                f"{WEIGHTS_FILE} header claims {header_bytes} bytes, above the limit of "
                f"{max_header_bytes}"
            )
        if header_bytes > file_bytes - 8:
            raise UploadRejected(
                f"{WEIGHTS_FILE} header claims {header_bytes} bytes, but the file holds "
                f"only {file_bytes - 8} after its length prefix"
            )
        raw = handle.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # ValueError: also 5,000-digit integers
        raise UploadRejected(f"{WEIGHTS_FILE} header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise UploadRejected(f"{WEIGHTS_FILE} header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise UploadRejected(f"{WEIGHTS_FILE} header __metadata__ must map strings to strings")
    entries = [_entry(name, value) for name, value in header.items()]
    if not entries:
        raise UploadRejected(f"{WEIGHTS_FILE} holds no tensors")
    # The data section must be tiled exactly: no gaps, no overlaps, nothing past the end.
    position = 0
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} starts at byte {entry.start}, "
                f"expected {position} (data sections overlap or leave gaps)"
            )
        position = entry.end
    if position != file_bytes - 8 - header_bytes:
        raise UploadRejected(
            f"{WEIGHTS_FILE}: tensors cover {position} bytes of data, the file holds "
            f"{file_bytes - 8 - header_bytes}"
        )
    return entries


def _check_tensors(
    entries: list[TensorEntry], model_config: ModelConfig, max_rank: int
) -> tuple[int, list[str], str]:
    """(max rank, sorted target modules, dtype name) of well-formed LoRA tensors."""
    ranks: dict[tuple[str, int, str], int] = {}
    known = _known_modules(model_config)
    for entry in entries:
        if parse_expert_tensor_name(entry.name) is not None:
            continue  # LoRA on a mixture's experts: the loader checks it (expert_lora.py)
        if parse_token_tensor_name(entry.name) is not None:
            continue  # an embedding or head table (modules_to_save, trainable tokens): the loader checks it
        parsed = parse_lora_tensor_name(entry.name)
        if parsed is None:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} is not a LoRA A/B weight or DoRA "
                "magnitude of a known module"
            )
        layer, module, which = parsed.layer, parsed.module, parsed.which
        if module not in known:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} targets unknown module {module!r} "
                f"(known: {', '.join(known)})"
            )
        if layer >= model_config.num_layers:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} names layer {layer}; the base model "
                f"has {model_config.num_layers} layers"
            )
        in_features, out_features = model_config.module_shape(module)
        shape = list(entry.shape)
        if which in ("M", "bias"):  # DoRA's magnitude, a LoRA bias: per output (loader pairs)
            if shape != [out_features]:
                raise UploadRejected(
                    f"{WEIGHTS_FILE}: tensor {entry.name!r} has shape {shape}; the base "
                    f"model's {module} needs [{out_features}]"
                )
            continue
        if which == "A":
            rank, fits = (shape[0] if shape else 0), len(shape) == 2 and shape[1] == in_features
            needed = f"[r, {in_features}]"
        else:
            rank, fits = (shape[-1] if shape else 0), len(shape) == 2 and shape[0] == out_features
            needed = f"[{out_features}, r]"
        if not fits:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} has shape {shape}; the base model's "
                f"{module} needs {needed}"
            )
        if rank < 1:
            raise UploadRejected(f"{WEIGHTS_FILE}: tensor {entry.name!r} has rank 0")
        if rank > max_rank:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} has rank {rank}, above the maximum "
                f"rank of {max_rank}"
            )
        key = (module, layer, which)
        if key in ranks:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} repeats layers.{layer}.{module}."
                f"lora_{which}"
            )
        ranks[key] = rank
    for (module, layer, which), rank in ranks.items():
        other = ranks.get((module, layer, "B" if which == "A" else "A"))
        if other is None:
            missing = "lora_B" if which == "A" else "lora_A"
            raise UploadRejected(f"{WEIGHTS_FILE}: layers.{layer}.{module} has no {missing}")
        if other != rank:
            raise UploadRejected(
                f"{WEIGHTS_FILE}: layers.{layer}.{module} has lora_A and lora_B of different ranks"
            )
    dtypes = sorted({entry.dtype for entry in entries})
    if len(dtypes) > 1:
        raise UploadRejected(f"{WEIGHTS_FILE} mixes dtypes {', '.join(dtypes)}")
    modules = sorted({module for module, _, _ in ranks})
    return max(ranks.values()), modules, FLOAT_DTYPES[dtypes[0]][0]


def _known_modules(model_config: ModelConfig) -> list[str]:
    """The module names an adapter may target: the seven, and the fused ones a family's
    checkpoint holds (Phi-3's ``qkv_proj``)."""
    return [*model_config.fused_modules, *LORA_TARGETS]


def _model_name(reference: str) -> str:
    """The last path component of a model id or path, lower-cased."""
    return reference.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()


def _check_config(
    config: AdapterConfig, model_config: ModelConfig, *, base_model_id: str | None, max_rank: int
) -> None:
    """What the platform adds to the engine's parse: the base model and the rank limit."""
    trained_on = config.base_model_name_or_path
    if trained_on and base_model_id and _model_name(trained_on) != _model_name(base_model_id):
        raise UploadRejected(
            f"{CONFIG_FILE}: the adapter was trained for base model {trained_on!r}, but "
            f"this server runs {base_model_id!r}"
        )
    targets = config.target_modules  # the parse let through only a str or a list of str
    if isinstance(targets, tuple):  # a string is a regex or "all-linear": tensors decide
        known = _known_modules(model_config)
        for target in targets:
            short = target.rsplit(".", 1)[-1]
            if short not in known:
                raise UploadRejected(
                    f"{CONFIG_FILE}: target module {target!r} is not known (known: "
                    f"{', '.join(known)})"
                )
    for where, rank in (("r", config.r), *config.rank_pattern.values()):
        if rank is not None and rank > max_rank:
            raise UploadRejected(
                f"{CONFIG_FILE}: rank {rank} ({where}) is above the maximum rank of {max_rank}"
            )


def _require_file(adapter_dir: Path, name: str) -> Path:
    path = adapter_dir / name
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UploadRejected(f"{name} must be a regular file")
    if not path.is_file():
        raise UploadRejected(f"{name} is missing from the upload")
    return path


def validate_adapter_dir(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    base_model_id: str | None,
    max_rank: int,
    max_bytes: int,
) -> AdapterInfo:
    """Check a PEFT adapter folder against the base model; raises ``UploadRejected``."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise UploadRejected(f"adapter folder {adapter_dir} does not exist")
    for entry in sorted(adapter_dir.iterdir()):
        if entry.suffix.lower() in PICKLE_SUFFIXES:
            raise UploadRejected(
                f"{entry.name} is a pickle file and is refused unopened; save the adapter "
                f"with safetensors ({WEIGHTS_FILE})"
            )
    config_path = _require_file(adapter_dir, CONFIG_FILE)
    weights_path = _require_file(adapter_dir, WEIGHTS_FILE)
    config_bytes = config_path.stat().st_size
    size_bytes = config_bytes + weights_path.stat().st_size
    if size_bytes > max_bytes:
        raise UploadRejected(
            f"the adapter is {size_bytes} bytes, above the size limit of {max_bytes}"
        )
    if config_bytes > MAX_CONFIG_BYTES:
        raise UploadRejected(f"{CONFIG_FILE} is {config_bytes} bytes, above {MAX_CONFIG_BYTES}")

    try:
        config = read_adapter_config(adapter_dir)
    except AdapterError as exc:
        raise UploadRejected(str(exc)) from exc
    _check_config(config, model_config, base_model_id=base_model_id, max_rank=max_rank)
    entries = read_safetensors_header(weights_path)
    rank, modules, dtype = _check_tensors(entries, model_config, max_rank)
    try:
        load_adapter(adapter_dir, model_config, max_rank=max_rank, dtype=STRICTEST_SERVING_DTYPE)
    except AdapterError as exc:
        raise UploadRejected(str(exc)) from exc
    return AdapterInfo(
        rank=rank,
        target_modules=modules,
        size_bytes=size_bytes,
        dtype=dtype,
    )
