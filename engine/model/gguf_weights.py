"""Read a GGUF Llama-family checkpoint's tensors in their packed form, keyed by HF names.

Quantized matrices stay quantized: each becomes a :class:`QuantizedWeight` (see
``loramux.kernels.quant_linear``) holding the file's integers and its scales as float32, so
serving a 4-bit GGUF never makes a float copy of its projections. Float tensors (norms,
and any matrix stored as F32, F16 or BF16) become float32 tensors.

How each GGML block type maps onto the packed forms (``G = 32`` but for Q6_K):

* ``Q8_0``: ``d`` (fp16) and 32 int8 ``q``; ``W = d * q`` is our ``int8``.
* ``Q5_0``: ``d``, 32 high bits, then 16 bytes of low nibbles: ``W = d * (q - 16)`` with
  ``q`` 5-bit is our ``int8`` holding ``q - 16`` (in -16..15).
* ``Q6_K``: super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, sixteen
  int8 scales ``sc_j`` and ``d``; ``W = (d sc_j) (q - 32)`` per 16 inputs is our ``int8``
  in groups of 16 (``d sc_j`` is 19 bits: exact in float32).
* ``Q4_0``: ``d`` and 16 bytes of nibbles; ``W = d * (q - 8)`` is our ``int4`` with
  ``scales = d``, ``mins = -8 d``.
* ``Q4_1``: ``d``, ``m`` and 16 bytes; ``W = d * q + m``.
* ``Q4_K``: super-blocks of 256: ``d``, ``dmin``, 12 bytes of eight 6-bit scales ``sc_j``
  and mins ``m_j``, then 128 bytes of nibbles; ``W = (d sc_j) q - dmin m_j``, so
  ``scales = d sc_j`` and ``mins = -(dmin m_j)`` per sub-block of 32.

Every product above is exact in float32 (fp16 has 11 significant bits, ``sc_j`` 6 and
``q`` at most 5), so ``dequantize`` of what we return rounds only in its final addition,
as gguf-py's ``dequantize`` does: the values are the same (a zero may differ in sign).

llama.cpp's converter reorders the rows of Llama's q and k projections (its RoPE pairs
adjacent features, HF's pairs the two halves of each head); rows are output features, so
we undo that by moving whole packed rows, as transformers' GGUF loader does to floats.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.gguf_file import GGUFFile, read_gguf
from loramux.kernels.quant_linear import QuantizedWeight

GGUFWeight = torch.Tensor | QuantizedWeight

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
QUANTIZED_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)
SUPPORTED_TYPES = FLOAT_TYPES + QUANTIZED_TYPES
GROUP_SIZE = 32  # inputs per scale in every supported quantized type but Q6_K
Q6_K_GROUP_SIZE = 16

# general.architecture -> whether llama.cpp permuted the q/k rows. Qwen2 and Qwen3 use
# NeoX-style RoPE in llama.cpp, the layout HF already has, so its converter leaves the rows
# alone.
ROWS_PERMUTED_BY_ARCHITECTURE = {"llama": True, "qwen2": False, "qwen3": False, "gemma3": False}
# Architectures whose norm weights llama.cpp's converter stored as 1 + w (Gemma's norms
# multiply by 1 + w): w is the file's value less 1, in float32, as transformers reads it.
NORMS_STORED_PLUS_ONE = {"gemma3"}

# Tensors a GGUF may carry that the engine recomputes from the config (Llama 3's RoPE
# frequency factors).
IGNORED_TENSORS = ("rope_freqs.weight",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
}
# Where an architecture names a layer's tensors otherwise: Gemma's ffn_norm is the norm
# before the MLP, and it has a norm after attention and one after the MLP.
_ARCHITECTURE_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def read_gguf_weights(path: str | Path, config: ModelConfig) -> dict[str, GGUFWeight]:
    """Every parameter of ``config``'s decoder from the GGUF file ``path``, by HF name.

    Quantized matrices come back as :class:`QuantizedWeight`, float tensors as float32.
    With tied embeddings there is no ``lm_head.weight`` (an ``output.weight`` in the file
    is then ignored, as the HF loader ignores ``lm_head``). Raises ValueError when the file
    is not a GGUF, describes another architecture or head layout than ``config``, or has
    a tensor that is missing, unexpected, of the wrong shape or of an unsupported type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    gguf = _open(path)
    permuted = _check_metadata(gguf.metadata, config, path)
    architecture = gguf.metadata["general.architecture"]
    expected = expected_shapes(config)
    weights: dict[str, GGUFWeight] = {}
    for tensor in gguf.tensors:
        if tensor.name in IGNORED_TENSORS:
            continue
        name = hf_name(tensor.name, architecture)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the engine ties lm_head to the embedding, as the config says
        if name is None or name not in expected:
            raise ValueError(
                f"unexpected tensor {tensor.name!r} in {path.name}: no parameter of the "
                f"configured model ({config.num_layers} layers) takes it"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (K) first
        if shape != expected[name]:
            raise ValueError(
                f"tensor {tensor.name!r} ({name}) in {path.name} has shape {shape}, "
                f"the config implies {expected[name]}"
            )
        weight = from_gguf_bytes(tensor.data, tensor.tensor_type, shape, name=tensor.name)
        if architecture in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1.0
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _select_rows(weight, rope_unpermute_index(shape[0], config.num_heads))
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _select_rows(weight, rope_unpermute_index(shape[0], config.num_kv_heads))
        weights[name] = weight
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"{path.name} lacks tensors the config needs: {shown}")
    return weights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter the decoder of ``config`` loads."""
    h, vocab = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    biased = {
        "q_proj": config.attention_bias,
        "k_proj": config.attention_bias,
        "v_proj": config.attention_bias,
        "o_proj": config.o_proj_bias,
        "gate_proj": config.mlp_bias,
        "up_proj": config.mlp_bias,
        "down_proj": config.mlp_bias,
    }
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        for module, has_bias in biased.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            in_features, out_features = config.module_shape(module)
            shapes[f"{prefix}.{block}.{module}.weight"] = (out_features, in_features)
            if has_bias:
                shapes[f"{prefix}.{block}.{module}.bias"] = (out_features,)
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
        if config.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (config.head_dim,)
        if config.gemma_norms:
            shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name (None when it has none)."""
    if match := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        names = {**_LAYER_NAMES, **_ARCHITECTURE_LAYER_NAMES.get(architecture, {})}
        module = names.get(part)
        return None if module is None else f"model.layers.{layer}.{module}.{kind}"
    if match := _GLOBAL_TENSOR.fullmatch(gguf_name):
        part, kind = match.groups()
        module = _GLOBAL_NAMES.get(part)
        return None if module is None else f"{module}.{kind}"
    return None


def rope_unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[index]``.

    llama.cpp views each head's ``D`` rows as ``[2, D/2]`` (HF's two rotary halves) and
    stores them transposed, ``[D/2, 2]`` (adjacent pairs), so HF row ``(h, j, i)`` is
    GGUF row ``h * D + 2 i + j``.
    """
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    gguf_rows = torch.arange(rows).view(num_heads, head_dim // 2, 2)  # [h, i, j]
    return gguf_rows.transpose(1, 2).reshape(rows)  # [h, j, i]


def from_gguf_bytes(
    data: np.ndarray,
    tensor_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    *,
    name: str = "tensor",
) -> GGUFWeight:
    """One tensor from its raw GGUF data (``shape`` in HF order: ``[N, K]`` or ``[K]``).

    ``data`` is the tensor's bytes (any dtype: only its bytes are read); the result
    owns its memory, so nothing refers to the file afterwards.
    """
    tensor_type = GGMLQuantizationType(tensor_type)
    if tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"tensor {name!r} has GGML type {tensor_type.name}, which loramux cannot read "
            f"natively (supported: {supported})"
        )
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    count = int(np.prod(shape))
    if shape[-1] % block_size or raw.size != count // block_size * type_size:
        raise ValueError(
            f"tensor {name!r}: {raw.size} bytes of {tensor_type.name} do not hold shape {shape}"
        )
    if tensor_type in FLOAT_TYPES:
        return torch.from_numpy(_float32(raw, tensor_type).reshape(shape))
    if len(shape) != 2:
        raise ValueError(
            f"tensor {name!r} of shape {shape} is quantized ({tensor_type.name}); only "
            "matrices may be (vectors must be F32, F16 or BF16)"
        )
    rows, cols = shape
    blocks = raw.reshape(rows, cols // block_size, type_size)  # [N, blocks per row, bytes]
    if tensor_type == GGMLQuantizationType.Q8_0:
        return _from_q8_0(blocks, rows)
    if tensor_type == GGMLQuantizationType.Q5_0:
        return _from_q5_0(blocks, rows)
    if tensor_type == GGMLQuantizationType.Q6_K:
        return _from_q6_k(blocks, rows)
    if tensor_type == GGMLQuantizationType.Q4_0:
        return _from_q4_0(blocks, rows)
    if tensor_type == GGMLQuantizationType.Q4_1:
        return _from_q4_1(blocks, rows)
    return _from_q4_k(blocks, rows)


# --- the file and its metadata ------------------------------------------------------------


def _open(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (ValueError, OSError, struct.error) as error:
        raise ValueError(f"{path.name} is not a readable GGUF file: {error}") from error


def _check_metadata(metadata: dict, config: ModelConfig, path: Path) -> bool:
    """Check the file's architecture and layout against ``config``; returns whether its q/k
    rows are permuted."""
    arch = metadata.get("general.architecture")
    if arch not in ROWS_PERMUTED_BY_ARCHITECTURE:
        supported = ", ".join(ROWS_PERMUTED_BY_ARCHITECTURE)
        raise ValueError(
            f"{path.name} holds a {arch!r} model; loramux reads GGUF architectures {supported}"
        )
    # Shapes alone cannot tell 9 heads of 64 from 18 of 32, which permute rows differently.
    for key, wanted in (
        ("block_count", config.num_layers),
        ("attention.head_count", config.num_heads),
        ("attention.head_count_kv", config.num_kv_heads),
    ):
        found = metadata.get(f"{arch}.{key}")
        if found is not None and found != wanted:
            raise ValueError(f"{path.name} has {arch}.{key} = {found}, the config {wanted}")
    return ROWS_PERMUTED_BY_ARCHITECTURE[arch]


# --- block formats -------------------------------------------------------------------------


def _select_rows(weight: GGUFWeight, index: torch.Tensor) -> GGUFWeight:
    return weight.rows(index) if isinstance(weight, QuantizedWeight) else weight[index]


def _float32(raw: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    if tensor_type == GGMLQuantizationType.F32:
        return raw.view(np.float32).copy()
    if tensor_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    # BF16 is the top half of a float32.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp16(field: np.ndarray) -> np.ndarray:
    """float32 values of 2-byte fp16 fields ``[..., 2]`` (exact)."""
    return np.ascontiguousarray(field).view(np.float16)[..., 0].astype(np.float32)


def _tensor(array: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array).reshape(rows, -1))


def _int4(packed: np.ndarray, scales: np.ndarray, mins: np.ndarray, rows: int) -> QuantizedWeight:
    """Our int4 form from packed bytes in our layout and per-32 scales and mins."""
    tensors = (_tensor(packed, rows), _tensor(scales, rows), _tensor(mins, rows))
    return QuantizedWeight("int4", *tensors, GROUP_SIZE)


def _from_q8_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # block: d fp16 | 32 x int8
    scales = _fp16(blocks[..., 0:2])  # [N, K/32]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return QuantizedWeight("int8", _tensor(q, rows), _tensor(scales, rows), None, GROUP_SIZE)


def _from_q5_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # block: d fp16 | qh: 32 high bits (bit j: input j) | 16 bytes, byte j = low nibbles
    # of inputs j and j + 16
    scales = _fp16(blocks[..., 0:2])
    high_bits = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [N, K/32, 1]
    high = (high_bits >> np.arange(32, dtype=np.uint32)) & 1  # [N, K/32, 32]
    qs = blocks[..., 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # inputs 0..15, then 16..31
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 16
    return QuantizedWeight(
        "int8", _tensor(q.astype(np.int8), rows), _tensor(scales, rows), None, GROUP_SIZE
    )


def _from_q6_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # super-block of 256: ql 128 bytes | qh 64 bytes | 16 int8 scales | d fp16. Each half
    # of 128 inputs takes 64 ql bytes and 32 qh bytes: input 32 c + l (c = 0..3, l < 32)
    # has ql[l + 32 (c % 2)]'s low (c < 2) or high nibble and qh[l]'s bits 2c, 2c + 1.
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [N, S, half, c % 2, l]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # [N, S, half, 1, l]
    sub_scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)  # [N, S, 16]
    d = _fp16(blocks[..., 208:210])  # [N, S]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # [N, S, half, c, l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    high = (qh >> shifts) & 3  # [N, S, half, c, l]
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    scales = d[..., None] * sub_scales.astype(np.float32)  # [N, S, 16]
    return QuantizedWeight(
        "int8", _tensor(q.astype(np.int8), rows), _tensor(scales, rows), None, Q6_K_GROUP_SIZE
    )


def _from_q4_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # block: d fp16 | 16 bytes, byte j = q[j] | q[j + 16] << 4 (our int4 layout already)
    scales = _fp16(blocks[..., 0:2])
    mins = scales * np.float32(-8.0)  # W = d (q - 8) = d q - 8 d, exact
    return _int4(blocks[..., 2:], scales, mins, rows)


def _from_q4_1(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # block: d fp16 | m fp16 | 16 bytes as Q4_0
    scales, mins = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    return _int4(blocks[..., 4:], scales, mins, rows)


def _from_q4_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # super-block of 256: d fp16 | dmin fp16 | 12 bytes of 6-bit scales, mins | 128 bytes
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [N, S]
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])  # [N, S, 8] each
    scales = d[..., None] * sub_scales.astype(np.float32)  # d sc_j: 17 bits, exact
    mins = -(dmin[..., None] * sub_mins.astype(np.float32))
    # Each 64 inputs are 32 bytes: inputs 0..31 in their low nibbles, 32..63 in the high
    # ones. Ours wants, per 32 inputs, byte j = input j | input j + 16 << 4: the low
    # nibbles of bytes j and j + 16, then the same for the high nibbles.
    qs = blocks[..., 16:].reshape(rows, -1, 4, 2, 16)  # [N, S, chunk of 64, half, 16]
    first, second = qs[..., 0, :], qs[..., 1, :]  # bytes j and j + 16 of each chunk
    low = (first & 0x0F) | (second << np.uint8(4))  # inputs 0..31 of the chunk
    high = (first >> np.uint8(4)) | (second & 0xF0)  # inputs 32..63
    packed = np.stack([low, high], axis=-2)  # [N, S, 4, 2, 16]
    return _int4(packed, scales, mins, rows)


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each super-block from its 12 bytes ``[..., 12]``.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7
    keep their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top
    2 bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], axis=-1)
    return scales, mins
