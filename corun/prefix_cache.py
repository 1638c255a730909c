"""Prefix-cache block hashes: a full block is keyed by its tokens and by everything before it.

vLLM's chained hash: ``hash(block i) = sha256(hash(block i - 1) || token ids of block i)``, the
first block chained to a fixed root. Two prompts share block i's hash exactly when their first
``(i + 1) * block_size`` tokens are the same, so a hash lookup walks a prompt's blocks from the
start and stops at the first miss. sha256 over a fixed-width encoding is the same in every
process and run (Python's ``hash`` of a tuple is too, for ints, but not of str/bytes under hash
randomisation; this keeps the key obviously stable). The cost is one sha256 of 8 * block_size
bytes per full prompt block, once per sequence.

Only full blocks are hashed: a partial last block is still being written by its owner.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = hashlib.sha256(b"corun-prefix-cache-v1").digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of one full block given its parent block's hash (``ROOT_HASH`` for block 0)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
