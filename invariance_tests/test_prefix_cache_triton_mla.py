"""Prefix-cache hits keep the bits on the Triton backend: the MLA model (the latent cache) and
corun's chunks below the prefill tile. The property, configs and workload are
test_prefix_cache_triton.py's (one file would run for a quarter of an hour on one worker)."""

from __future__ import annotations

import pytest

from invariance_tests.test_prefix_cache_triton import check_hit_equals_miss, pytestmark

__all__ = ["pytestmark"]  # the same skip off the interpreter


@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch_invariant", "corun-C64"])
def test_hit_equals_miss_on_the_triton_backend_mla(name):
    check_hit_equals_miss("tiny-deepseek-v3", name)


@pytest.mark.slow
def test_hit_equals_miss_with_chunks_below_the_tile():
    check_hit_equals_miss("tiny-qwen3", "corun-C16")
