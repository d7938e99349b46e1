"""The tile table of the Triton LoRA kernels: its entries parse, unknown GPUs take the
default, bad tiles are refused, and a tuning run's entry round-trips through the file."""

from __future__ import annotations

import json

import pytest

from loramux.benchmarks.kernels_gpu.tune import write_table
from loramux.kernels.lora_tiles import FusedTiles, PhaseTiles, tiles_for


def test_every_entry_parses_and_says_where_it_came_from():
    from importlib import resources

    text = resources.files("loramux.kernels").joinpath("lora_tiles.json").read_text()
    table = json.loads(text)
    assert "default" in table
    for name, entry in table.items():
        tiles = PhaseTiles.from_json(entry)
        assert tiles.source, name
        assert tiles.fused_max_tokens >= 1


def test_an_unknown_gpu_takes_the_default():
    assert tiles_for("NVIDIA Imaginary 1") == tiles_for(None) == tiles_for("default")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_k": 48}, "block_k must be a power of two"),
        ({"block_n": 8}, "block_n must be a power of two ≥ 16"),
        ({"num_warps": 3}, "num_warps a power of two"),
        ({"target_programs": 0}, "target_programs ≥ 1"),
    ],
)
def test_bad_tiles_are_refused(fields, message):
    good = {"block_k": 64, "block_n": 64, "target_programs": 8, "num_warps": 4}
    with pytest.raises(ValueError, match=message):
        FusedTiles(**{**good, **fields})


def test_a_tuned_entry_round_trips_through_the_table(tmp_path):
    path = tmp_path / "lora_tiles.json"
    path.write_text(json.dumps({"default": tiles_for(None).to_json()}))
    tuned = PhaseTiles(
        decode=FusedTiles(block_k=512, block_n=64, target_programs=264, num_warps=8),
        segments=FusedTiles(block_k=128, block_n=128, target_programs=132, num_warps=4),
        fused_max_tokens=256,
        source="tuned on NVIDIA H200 on 2026-11-29 by kernels_gpu_tune",
    )
    write_table("NVIDIA H200", tuned, path)
    table = json.loads(path.read_text())
    assert PhaseTiles.from_json(table["NVIDIA H200"]) == tuned
    assert PhaseTiles.from_json(table["default"]) == tiles_for(None)
