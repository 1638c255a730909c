"""MLA launch tiles and their H200 tuned table (kernels/tuned/mla_h200.json).

``MLATile`` is the tunable part of an ``mla_decode`` / ``mla_prefill_attention`` launch;
``MLATunedTable`` holds the tiles experiments/tune_mla.py measured fastest, and the policies in
``kernels/mla.py`` look them up (a pure lookup, no timing at run time). Keys are what each policy
may depend on: decode under corun / batch_invariant never reads the batch size, prefill reads only
the head dims, so the table cannot make a row's bits depend on its co-runners (see kernels/mla.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.mode import Mode
from kernels.utils import (
    check_block_size,
    check_num_warps,
    check_positive_int,
    config_from_dict,
    load_tuned_json,
)

__all__ = ["TUNED_PATH", "MLATile", "MLATunedTable", "checked_in_table", "load_mla_tuned"]

# Measured tiles, written by experiments/tune_mla.py; absent -> the literal policies in mla.py.
TUNED_PATH = Path(__file__).resolve().parent / "tuned" / "mla_h200.json"


@dataclass(frozen=True)
class MLATile:
    """The tunable part of a launch: tile sizes and pipelining.

    For decode, ``block_m`` is BLOCK_H (query heads per program, 16/32/64: more heads per program
    means fewer re-reads of each cache tile but a larger [BLOCK_H, latent] fp32 accumulator). For
    prefill it is the query tile. ``block_n`` (tokens per inner step) fixes the online-softmax
    reduction order, so it is part of a row's bits; the rest only change speed. ``dv_parts``
    (decode only; prefill takes 1) splits the latent output columns over that many programs, each
    computing the same scores: a [BLOCK_H, 512 / dv_parts] accumulator instead of [BLOCK_H, 512].
    Like the rest of the tile it is fixed per shape by the policy (a column's bits may depend on
    it: the interpreter's dot regroups a sum with the tile width). ``tma`` (prefill only) brings
    the key and value tiles in through Hopper TMA descriptors: the same tiles into the same dots.
    ``preload_pages`` (decode only) loads a split's block ids once before its token loop
    (``kernels.mla.preloaded_pages`` says how many, or none where a split spans too many pages):
    the same rows into the same dots, so the same bits. ``reload_values`` (decode only) loads the
    latent rows that P.V takes one step late again in that step instead of carrying them in
    registers: the same rows into the same dots too.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    dv_parts: int = 1
    tma: bool = False  # prefill only: key and value tiles through TMA descriptors
    preload_pages: bool = False  # decode only: a split's block ids loaded before its token loop
    reload_values: bool = False  # decode only: P.V's latent rows loaded again, not carried

    def __post_init__(self) -> None:
        check_block_size("block_m", self.block_m)
        check_block_size("block_n", self.block_n)
        check_num_warps("num_warps", self.num_warps)
        check_positive_int("num_stages", self.num_stages)
        if self.dv_parts not in (1, 2, 4, 8):
            raise ValueError(f"dv_parts: expected 1, 2, 4 or 8, got {self.dv_parts!r}")
        for name in ("tma", "preload_pages", "reload_values"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """The tile in words, as reports and tables name it."""
        parts = f", {self.dv_parts} value parts" if self.dv_parts > 1 else ""
        return (f"{self.block_m} x {self.block_n}, {self.num_warps} warps, {self.num_stages} "
                f"stages{parts}{', TMA-fed' if self.tma else ''}"
                f"{', block ids preloaded' if self.preload_pages else ''}"
                f"{', values reloaded' if self.reload_values else ''}")

    @property
    def has_decode_options(self) -> bool:
        """Whether the tile sets an option only decode has (a prefill tile must not)."""
        return self.dv_parts != 1 or self.preload_pages or self.reload_values

    def to_dict(self) -> dict:
        # Tiles without the newer options keep the file format they were written in.
        data = dataclasses.asdict(self)
        if self.dv_parts == 1:
            del data["dv_parts"]
        for name in ("tma", "preload_pages", "reload_values"):
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> MLATile:
        return config_from_dict(cls, data)


def _at_or_above(rows: tuple[tuple[int, MLATile], ...], value: int) -> MLATile:
    """The entry tuned at the smallest key >= value (the largest key past the end)."""
    return next((tile for key, tile in rows if value <= key), rows[-1][1])


@dataclass(frozen=True)
class MLATunedTable:
    """H200 measurements for 16-bit inputs (kernels/tuned/mla_h200.json).

    - ``decode_fixed[(heads, latent, rope, split_size)]``: (max_seq_len, tile) rows for corun and
      batch_invariant; ONE tile per engine, chosen over every tuned batch size (it never reads B).
    - ``decode_default[(heads, latent, rope)]``: (batch, max_seq_len, tile) rows for default.
    - ``prefill[(qk_dim, v_dim)]``: one tile for every mode and length.
    """

    decode_fixed: dict[tuple[int, int, int, int], tuple[tuple[int, MLATile], ...]]
    decode_default: dict[tuple[int, int, int], tuple[tuple[int, int, MLATile], ...]]
    prefill: dict[tuple[int, int], MLATile]

    def decode_tile(
        self, batch: int, num_heads: int, latent_dim: int, rope_dim: int, max_seq_len: int,
        dtype: torch.dtype, mode: Mode, split_size: int,
    ) -> MLATile | None:  # fmt: skip
        if dtype.itemsize != 2:  # tuned in bf16; fp16 shares its tile economics, fp32 does not
            return None
        if mode is not Mode.DEFAULT:
            rows = self.decode_fixed.get((num_heads, latent_dim, rope_dim, split_size))
            return _at_or_above(rows, max_seq_len) if rows else None
        rows3 = self.decode_default.get((num_heads, latent_dim, rope_dim))
        if not rows3:
            return None
        batches = sorted({b for b, _, _ in rows3})
        tuned_b = next((b for b in batches if batch <= b), batches[-1])
        return _at_or_above(tuple((c, t) for b, c, t in rows3 if b == tuned_b), max_seq_len)

    def prefill_tile(self, qk_dim: int, v_dim: int, dtype: torch.dtype) -> MLATile | None:
        return self.prefill.get((qk_dim, v_dim)) if dtype.itemsize == 2 else None


def load_mla_tuned(path: Path | str) -> MLATunedTable:
    """Parse a tuned file: ``{"header": {...}, "entries": [{"kind": "decode_fixed" |
    "decode_default" | "prefill", <keys>, "config": {block_m, block_n, num_warps, num_stages}}]}``.

    A missing file gives an empty table (the literal policies); a malformed one raises ValueError
    naming the path (``kernels.utils.load_tuned_json``).
    """
    table = load_tuned_json(path, "MLA tuned table", _parse_tuned_table)
    return table or MLATunedTable({}, {}, {})


def _parse_tuned_table(data: dict) -> MLATunedTable:
    fixed: dict = {}
    default: dict = {}
    prefill: dict = {}
    for entry in data["entries"]:
        tile = MLATile.from_dict(entry["config"])
        kind = entry["kind"]
        if kind == "prefill":
            if tile.has_decode_options:
                raise ValueError(f"prefill {tile}: dv_parts, preload_pages and reload_values are "
                                 "decode-only")
            prefill[(int(entry["qk_dim"]), int(entry["v_dim"]))] = tile
            continue
        if tile.tma:
            raise ValueError("decode tma: TMA is a prefill-only field")
        dims = (int(entry["heads"]), int(entry["latent"]), int(entry["rope"]))
        if tile.block_m > 64:
            raise ValueError(f"decode block_m (BLOCK_H) {tile.block_m} > 64")
        if kind == "decode_fixed":
            key = (*dims, int(entry["split_size"]))
            fixed.setdefault(key, []).append((int(entry["ctx"]), tile))
        elif kind == "decode_default":
            default.setdefault(dims, []).append((int(entry["batch"]), int(entry["ctx"]), tile))
        else:
            raise ValueError(f"unknown entry kind {kind!r}")
    return MLATunedTable(
        decode_fixed={k: tuple(sorted(v, key=lambda r: r[0])) for k, v in fixed.items()},
        decode_default={k: tuple(sorted(v, key=lambda r: r[:2])) for k, v in default.items()},
        prefill=prefill,
    )


@functools.cache
def checked_in_table() -> MLATunedTable:
    """kernels/tuned/mla_h200.json, read once per process (the policies' default table)."""
    return load_mla_tuned(TUNED_PATH)
