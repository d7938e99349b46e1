"""A quantized paged KV cache: 8-bit keys and values, one float32 scale per slot and head.

Maths, per token t and KV head h of a layer's keys (values alike), x = k[t, h, :] after
RoPE, as the model writes it:

    s[t, h] = max_d |x_d| / QMAX                     (0 when x is all zeros)
    q[t, h, d] = round(x_d / s[t, h])  clamped to ±QMAX     int8,   QMAX = 127
               = fp8_e4m3(x_d / s[t, h])                    fp8,    QMAX = 448
    x̂_d = q[t, h, d] · s[t, h]                      what attention reads

``KV_CACHE_DTYPES`` names the modes: ``int8`` (the CPU's), ``fp8`` (e4m3, CUDA's; the torch
path runs it on the CPU too, for its tests). Attention is the float attention of
``paged_attention`` over x̂, computed in the query's dtype.

Why a scale per slot (token) rather than one per block: a slot's bytes then depend on its
own token only, never on which tokens shared its block or in what order they were written.
A block's KV is the same whether its prompt arrived in one chunk or token by token, after
a preemption's recompute or from the prefix cache, so the engine's tokens do not depend on
scheduling, and the reference (transformers + PEFT with the same fake quantization in its
cache, ``fake_quantize_kv``) is token-exact. It costs 4 bytes per 64-wide head: 68 bytes
where float32 takes 256 (3.8x) and bfloat16 128 (1.9x). Writes need no re-scaling pass
and no host round trip (CUDA-graph safe).

Layout: a block is ``block_bytes`` contiguous bytes, its data ``[block_size, kv_heads,
head_dim]`` in the 8-bit dtype, then its scales ``[block_size, kv_heads]`` float32. So a
block is one piece of memory: the device arena lays blocks and adapter rows over the same
bytes with no room kept for scales (a block an adapter takes frees its scales' bytes too),
a block move or a prefix-cache hit carries its scales, and ``QuantizedKV.data`` and
``.scales`` are strided views ``[num_blocks, ...]`` that the Triton kernels read by
stride. Slots never written hold stale bytes (an earlier sequence's, or an adapter's
weights): attention masks them, and an fp8 byte there may be NaN (0x7F/0xFF), which the
torch gather reads as 0 and the Triton kernels never load.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model's own dtype, not quantized
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The 8-bit dtype of a quantized mode, None for ``auto``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return _STORAGE.get(kv_cache_dtype)


def bytes_per_slot_head(head_dim: int, storage: torch.dtype) -> int:
    """Bytes one token's key (or value) for one KV head takes: data and its scale."""
    return head_dim * storage.itemsize + SCALE_DTYPE.itemsize


class QuantizedKV:
    """One layer's quantized keys (or values) over ``raw``, ``[num_blocks, block_bytes]``
    bytes: each block its 8-bit data then its scales (module docstring)."""

    def __init__(
        self, raw: torch.Tensor, block_size: int, kv_heads: int, head_dim: int, storage: torch.dtype
    ):
        if storage not in _QMAX:
            raise ValueError(f"quantized KV data must be int8 or float8_e4m3fn, not {storage}")
        data_bytes = block_size * kv_heads * head_dim * storage.itemsize
        block_bytes = data_bytes + block_size * kv_heads * SCALE_DTYPE.itemsize
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != block_bytes:
            raise ValueError(
                f"raw must be uint8 [num_blocks, {block_bytes}], got {raw.dtype} {tuple(raw.shape)}"
            )
        if not raw.is_contiguous():
            raise ValueError("raw must be contiguous")
        self.raw = raw
        # Strided views (block stride: block_bytes): the data as its dtype and as bytes
        # (torch's CPU index ops do not take fp8), the scales as float32.
        self.data_bytes = raw[:, :data_bytes].unflatten(1, (block_size, kv_heads, head_dim))
        self.data = self.data_bytes.view(storage)
        self.scales = raw[:, data_bytes:].view(SCALE_DTYPE).unflatten(1, (block_size, kv_heads))

    @classmethod
    def empty(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        storage: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> QuantizedKV:
        """A zeroed cache of its own (the engine's lie over the arena's memory instead)."""
        block_bytes = block_size * kv_heads * bytes_per_slot_head(head_dim, storage)
        raw = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=device)
        return cls(raw, block_size, kv_heads, head_dim, storage)

    @property
    def shape(self) -> torch.Size:  # [num_blocks, block_size, kv_heads, head_dim]
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.raw.device


def quantize_kv(
    x: torch.Tensor,  # [..., head_dim]
    storage: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [..., head_dim] storage, scales [...] float32)
    """The module docstring's q and s for every leading index of ``x``."""
    qmax = _QMAX[storage]
    x = x.to(torch.float32)
    scales = x.abs().amax(dim=-1) / qmax
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = (x / divisor[..., None]).clamp_(-qmax, qmax)
    if storage == torch.int8:
        return scaled.round_().to(torch.int8), scales
    return scaled.to(storage), scales


def dequantize_kv(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [..., head_dim] in ``dtype``
    """x̂ = q · s. A NaN fp8 byte (a stale slot's; quantize never writes one) reads as 0."""
    values = q.to(torch.float32)
    if q.dtype == torch.float8_e4m3fn:
        values = values.nan_to_num_(nan=0.0)
    return (values * scales[..., None]).to(dtype)


def fake_quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x̂ for a float ``x`` (``[..., head_dim]``) in its own dtype: what the reference model
    stores in its cache to match an engine with a quantized KV cache."""
    storage = storage_dtype(kv_cache_dtype)
    if storage is None:
        return x
    q, scales = quantize_kv(x, storage)
    return dequantize_kv(q, scales, x.dtype)


def _block_and_offset(cache: QuantizedKV, slots: torch.Tensor):
    block_size = cache.data.shape[1]
    return slots // block_size, slots % block_size


def write_quantized_kv(
    x: torch.Tensor,  # [T, kv_heads, head_dim]
    cache: QuantizedKV,
    slot_mapping: torch.Tensor,  # [T] int64 flat slots
) -> None:
    """``cache.flat[slot_mapping[t]] = quantize(x[t])``, data and scales, in place."""
    q, scales = quantize_kv(x, cache.data.dtype)
    index = _block_and_offset(cache, slot_mapping)
    cache.data_bytes.index_put_(index, q.view(torch.uint8))
    cache.scales.index_put_(index, scales)


def gather_quantized_kv(
    cache: QuantizedKV, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [N, kv_heads, head_dim]
    """x̂ at the flat ``slots`` (``[N]``), in ``dtype``."""
    index = _block_and_offset(cache, slots)
    q = cache.data_bytes[index].view(cache.data.dtype)
    return dequantize_kv(q, cache.scales[index], dtype)


def gather_quantized_context(
    cache: QuantizedKV, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [R, L, kv_heads, head_dim]
    """x̂ at ``slots`` (``[R, L]``), each row the slots of positions ``0 .. L-1`` through one
    block table (so whole blocks in order, the last cut short): what attention reads of a
    context. Copies whole blocks, data and scales together, with one ``index_select`` of
    their bytes (a quarter of the time of indexing slot by slot); the de-quantization
    after it is most of this path's cost on a CPU."""
    rows, length = slots.shape
    _, block_size, heads, head_dim = cache.data.shape
    blocks = slots[:, ::block_size] // block_size  # [R, ceil(L / block_size)]
    per_row = blocks.shape[1]
    raw = cache.raw.index_select(0, blocks.reshape(-1))  # [R * per_row, block_bytes]
    data_bytes = block_size * heads * head_dim * cache.data.dtype.itemsize
    q = raw[:, :data_bytes].view(cache.data.dtype).view(-1, block_size, heads, head_dim)
    scales = raw[:, data_bytes:].view(SCALE_DTYPE).view(-1, block_size, heads)
    values = dequantize_kv(q, scales, dtype)  # [R * per_row, block_size, heads, head_dim]
    return values.view(rows, per_row * block_size, heads, head_dim)[:, :length]
