"""The GGUF header reader (``engine/model/gguf_file.py``) against gguf-py's own reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from loramux.engine.model.gguf_file import read_gguf


def _write(path, *, alignment: int | None = None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(3)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_string("general.name", "tiny")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.standard_normal((8, 64)).astype(np.float32),
        "b.weight": gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q4_1),
        "c.weight": rng.standard_normal(5).astype(np.float32),
    }
    for name, array in tensors.items():
        raw_dtype = T.Q4_1 if name == "b.weight" else None
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_scalars_and_tensors_match_gguf_py(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment=alignment)
    ours = read_gguf(path)
    assert ours.metadata["general.architecture"] == "llama"
    assert ours.metadata["llama.block_count"] == 3
    assert ours.metadata["llama.attention.head_count"] == 4
    assert ours.metadata["general.name"] == "tiny"
    assert ours.metadata["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.tokens" not in ours.metadata  # arrays are skipped
    theirs = gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(int(n) for n in reference.shape)
        assert bytes(mine.data) == reference.data.tobytes()


def test_a_file_cut_short_or_not_gguf_is_refused(tmp_path):
    path = _write(tmp_path / "m.gguf")
    data = path.read_bytes()
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="ends inside its header"):
        read_gguf(tmp_path / "head.gguf")
    (tmp_path / "body.gguf").write_bytes(data[:-64])
    with pytest.raises(ValueError, match="past the end of the file"):
        read_gguf(tmp_path / "body.gguf")
    (tmp_path / "text.gguf").write_bytes(b"not a model at all, just some words")
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(tmp_path / "text.gguf")


def test_a_big_endian_file_is_named_as_one(tmp_path):
    data = bytearray(_write(tmp_path / "m.gguf").read_bytes())
    data[4:8] = (3).to_bytes(4, "big")  # the version as a big-endian writer stores it
    (tmp_path / "big.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="big-endian"):
        read_gguf(tmp_path / "big.gguf")
