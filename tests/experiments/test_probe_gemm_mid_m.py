"""The mid-M GEMM probe's choice of the tile whose loads it replays alone."""

from __future__ import annotations

from experiments.probe_gemm_mid_m import fastest_whole_tile
from kernels.gemm import GemmConfig


def _variant(name: str, us: float, config: GemmConfig) -> dict:
    return {"name": name, "config": config.to_dict(), "us": us}


def test_fastest_whole_tile_skips_splits_persistence_stream_k_plain_loads_and_short_rows():
    tma = dict(num_warps=4, num_stages=3, tma=True)
    variants = [
        _variant("whole 128", 12.0, GemmConfig(128, 64, 64, **tma)),
        _variant("whole 128 deep", 11.0, GemmConfig(128, 64, 64, **{**tma, "num_stages": 7})),
        _variant("split 2", 5.0, GemmConfig(128, 64, 64, split_k=2, **tma)),
        _variant("persistent", 5.0, GemmConfig(128, 64, 64, persistent=True, **tma)),
        _variant("stream-K", 5.0, GemmConfig(128, 64, 64, stream_k_programs=132, **tma)),
        _variant("plain loads", 5.0, GemmConfig(128, 64, 64, num_warps=4, num_stages=3)),
        _variant("64 rows", 5.0, GemmConfig(64, 64, 64, **tma)),  # does not cover M 128
        {"name": "did not build", "error": "out of resources"},
    ]
    variant, config = fastest_whole_tile(variants, 128)
    assert variant["name"] == "whole 128 deep" and config.num_stages == 7
    assert fastest_whole_tile(variants, 64)[0]["name"] == "64 rows"
    assert fastest_whole_tile(variants, 256) is None
