"""Shared hypothesis strategies for the invariance properties (STYLE.md §14).

Strategies draw *structure*: sizes (with block multiples and their ±1 neighbours, where tiling
bugs live), row indices, permutations, batch compositions and 64-bit seeds. Tensor contents come
from a ``torch.Generator`` seeded by the drawn seed (``randn``), which is fast and shrinks to a
meaningful (shape, seed) pair.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

SEED_MAX = 2**64 - 1


def seeds() -> st.SearchStrategy[int]:
    """A 64-bit seed for ``randn``."""
    return st.integers(min_value=0, max_value=SEED_MAX)


def sizes(
    min_size: int = 1, max_size: int = 128, blocks: Sequence[int] = (16, 32, 64)
) -> st.SearchStrategy[int]:
    """A dimension in [min_size, max_size]: half the time a block multiple or a neighbour (±1),
    otherwise any value in range."""
    near_blocks = sorted({
        b * i + d
        for b in blocks
        for i in range(1, max_size // b + 1)
        for d in (-1, 0, 1)
        if min_size <= b * i + d <= max_size
    })
    anywhere = st.integers(min_value=min_size, max_value=max_size)
    return st.one_of(st.sampled_from(near_blocks), anywhere) if near_blocks else anywhere


@st.composite
def size_pairs(draw, min_size: int = 1, max_size: int = 128, blocks: Sequence[int] = (16, 32, 64)):
    """Two distinct sizes ``small < large`` (e.g. two batch sizes for a batch-invariance check)."""
    a = draw(sizes(min_size, max_size, blocks))
    b = draw(sizes(min_size, max_size, blocks).filter(lambda v: v != a))
    return (a, b) if a < b else (b, a)


def row_index(num_rows: int) -> st.SearchStrategy[int]:
    """A row in [0, num_rows)."""
    return st.integers(min_value=0, max_value=num_rows - 1)


def permutation(n: int) -> st.SearchStrategy[list[int]]:
    """A permutation of range(n)."""
    return st.permutations(list(range(n)))


def batch_lengths(
    max_batch: int = 4, min_len: int = 1, max_len: int = 64, blocks: Sequence[int] = (16, 32)
) -> st.SearchStrategy[list[int]]:
    """A batch composition: per-sequence lengths (e.g. prompt or context lengths)."""
    return st.lists(sizes(min_len, max_len, blocks), min_size=1, max_size=max_batch)


def randn(
    shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    """Standard normal tensor from a Generator seeded by ``seed``, cast to ``dtype`` (CPU)."""
    gen = torch.Generator().manual_seed(seed % 2**64)  # seed + offset may pass 2**64
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)
