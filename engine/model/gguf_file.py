"""A GGUF file's header and tensor table, read without building its metadata in Python.

gguf-py's ``GGUFReader`` turns every metadata value into numpy objects, which for a model
with a 49,152-token vocabulary is about 100,000 small arrays: 2-3 s and a few hundred MB of
a serving process's memory before a single weight is read. The engine needs the file's
scalar and string metadata (architecture, head counts) and where each tensor's bytes are,
so this reads exactly that: arrays in the metadata (the tokenizer's) are skipped by their
lengths, and each tensor's bytes are a view of the memory-mapped file.

Layout (little-endian, GGUF versions 2 and 3): magic ``GGUF``, version u32, tensor count
u64, metadata count u64; then each metadata entry (a key string, a value type u32, the
value); then each tensor's info (name, dimension count u32, dimensions u64 each with
``ne0`` first, GGML type u32, offset u64 from the data section); the data section starts at
the next multiple of ``general.alignment`` (32 unless the file says otherwise). A string
is a u64 length and that many UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: 0-7 and 10-12 are scalars (struct format), 8 a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as the file lists it: ne0 (a row's length) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 view of its bytes in the mapped file


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, int | float | bool | str]  # scalars and strings; arrays are skipped
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer, path: Path):
        self.buffer, self.offset, self.path = buffer, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError(f"{self.path.name} ends inside its header (truncated?)")
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"{self.path.name} ends inside its header (truncated?)")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_string(self) -> None:
        length = self.unpack("Q")  # read before the offset moves on by it
        self.offset += length

    def value(self, value_type: int):
        """The value of ``value_type`` (None for an array, which is skipped)."""
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif item_type in _SCALARS:
                self.offset += count * struct.calcsize("<" + _SCALARS[item_type])
            else:
                raise ValueError(f"{self.path.name}: an array of value type {item_type}")
            return None
        raise ValueError(f"{self.path.name}: unknown metadata value type {value_type}")


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and tensor table of the GGUF file ``path``; ValueError when it is not
    one (or is cut short)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    if len(mapped) < 24 or bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file (no GGUF magic at its start)")
    cursor.offset = 4
    version, tensor_count, metadata_count = cursor.unpack("IQQ")
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise ValueError(f"{path.name} is a big-endian GGUF file; only little-endian is read")
        raise ValueError(f"{path.name} is GGUF version {version}; loramux reads {VERSIONS}")
    metadata = {}
    for _ in range(metadata_count):
        key = cursor.string()
        value = cursor.value(cursor.unpack("I"))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.unpack("I")
        shape = tuple(int(cursor.unpack("Q")) for _ in range(dims))
        type_id, offset = cursor.unpack("IQ")
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(
                f"{path.name}: tensor {name!r} has unknown GGML type {type_id}"
            ) from None
        infos.append((name, shape, tensor_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, tensor_type, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        nbytes = int(np.prod(shape)) // block_size * type_size
        first = start + offset
        if first + nbytes > len(mapped):
            raise ValueError(f"{path.name}: tensor {name!r} lies past the end of the file")
        tensors.append(GGUFTensor(name, shape, tensor_type, mapped[first : first + nbytes]))
    return GGUFFile(metadata, tensors)
