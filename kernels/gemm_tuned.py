"""GEMM launch configs and their tuned tables (kernels/tuned/gemm_<card>.json).

``GemmConfig`` is one launch of ``kernels.gemm.gemm``; ``TunedTable`` holds the configs
experiments/tune_gemm.py measured fastest on one card, per (N, K) and tuned M, and
``kernels.gemm``'s policies look them up (a pure lookup, no timing at run time). The H200's table
is every card's base (``BASE_CARD``); another card's file holds the points tuned on that card,
which ``overlay`` puts in place of the H200's (``table_files`` lists what a card reads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.utils import (
    check_block_size,
    check_num_warps,
    check_positive_int,
    config_from_dict,
    load_tuned_json,
)

__all__ = ["BASE_CARD", "TUNED_DIR", "TUNED_PATH", "GemmConfig", "TunedTable",
           "load_tuned_table", "overlay", "table_files", "tuned_path"]

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
# The card whose table every other card's points overlay (and the interpreter runs).
BASE_CARD = "h200"
TUNED_PATH = TUNED_DIR / f"gemm_{BASE_CARD}.json"


def tuned_path(card: str) -> Path:
    """``kernels/tuned/gemm_<card>.json``: the configs tuned on ``card``
    (``kernels.utils.device_card``)."""
    return TUNED_DIR / f"gemm_{card}.json"


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. ``block_k`` and ``split_k`` fix a row's reduction order;
    the rest (tile shape, grouping, warps, stages, persistence) only change speed."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # Persistent: at most one program per SM, each looping over tiles.
    persistent: bool = False
    # Tiles of x and w brought in by the Hopper tensor-memory accelerator (host-side descriptors)
    # instead of per-thread loads: the same tiles into the same dot, so the same bits.
    tma: bool = False
    # Stream-K (0: off): exactly this many programs, each streaming an equal share of the
    # (column tile, K block) iterations, for one row tile (M <= block_m). Where a share ends
    # inside a column tile, the tile's K walk is cut there and its pieces are summed in order by
    # the reduce launch: fixed by (N, K, the tiles and this count), so part of a row's reduction
    # order, and never a function of M or the device. It fills every SM when the tiles alone
    # would leave a partial last wave (96 tiles of Qwen3-8B's qkv at M 128 on 132 SMs).
    stream_k_programs: int = 0
    # Rows past M masked out of the x loads (zeros) instead of re-reading row ``r % M``: no
    # memory request for them; they are never stored and an MMA row never reads another, so the
    # bits are the same. The policies set it where M < block_m (``with_row_mask``): on an H100
    # the same pick re-reading the rows took 1.01-1.74x as long as masked at M 1 (every row of
    # the tile re-read the one real row), median 1.01x at M 8 (experiments/results/
    # kernels-h100.json, the ``corun_mask_rows`` rows of bench_gemm; probe-gemm-m1-h100.json).
    # A full tile gains nothing from the mask and pays for it (shared.down at M 32: masked 9.9 us
    # against 8.3 re-read).
    mask_rows: bool = False
    # A second, narrower product a program computes from the same x tiles (0: none): each
    # column tile is block_n + block_n_tail wide, a width no power-of-two tile has, without a
    # second pass over x. DeepSeek-V3's kv_a (N 576) takes 3 tiles of 128 + 64; its pick of
    # 64 x 256 computes 768 columns for 576, and a column split into two launches (512 wide
    # columns, 64 narrow) reads all of x twice: 0.70 of cuBLAS at M 8192 on an H100 at best
    # (experiments/results/probe-gemm-narrow-n-h100.json). Each output element is still summed
    # over K in block_k steps, so the tail keeps a row's reduction order.
    block_n_tail: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            check_block_size(name, getattr(self, name))
        for name in ("split_k", "group_m", "num_stages"):
            check_positive_int(name, getattr(self, name))
        check_num_warps("num_warps", self.num_warps)
        for name in ("persistent", "tma", "mask_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.block_n_tail:
            check_block_size("block_n_tail", self.block_n_tail)
            if self.block_n_tail >= self.block_n:
                raise ValueError(f"block_n_tail: expected 0 or below block_n {self.block_n}, "
                                 f"got {self.block_n_tail}")
        programs = self.stream_k_programs
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
            raise ValueError(f"stream_k_programs: expected an int >= 0, got {programs!r}")
        if programs and (self.split_k != 1 or self.persistent):
            raise ValueError("stream_k_programs: stream-K cuts K itself and sizes its own grid; "
                             f"expected split_k 1 and persistent False, got split_k "
                             f"{self.split_k}, persistent {self.persistent}")
        if programs and self.block_n_tail:
            raise ValueError("stream_k_programs: stream-K walks column tiles of block_n; "
                             f"expected block_n_tail 0, got {self.block_n_tail}")

    @property
    def keeps_k_whole(self) -> bool:
        """A row's K summed in one program, neither split nor streamed: what
        ``batch_invariant_tuned``'s no-split entries must be."""
        return self.split_k == 1 and not self.stream_k_programs

    @property
    def tile_n(self) -> int:
        """The columns of one output tile: block_n, and the tail's beside it."""
        return self.block_n + self.block_n_tail

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the software pipeline: one x and one w tile (and tail) per stage."""
        return (self.block_m + self.tile_n) * self.block_k * itemsize * self.num_stages

    @property
    def label(self) -> str:
        """The config in words, as reports and tables name it."""
        extras = (", TMA-fed" * self.tma + ", persistent" * self.persistent
                  + (f", stream-K {self.stream_k_programs}" if self.stream_k_programs else ""))
        width = (f"({self.block_n} + {self.block_n_tail})" if self.block_n_tail
                 else f"{self.block_n}")
        return (f"{self.block_m} x {width} x {self.block_k}, split {self.split_k}, "
                f"{self.num_warps} warps, {self.num_stages} stages{extras}")

    def to_dict(self) -> dict:
        # Configs without TMA, stream-K, masked rows or a tail keep the format the tuned files
        # were written in.
        data = dataclasses.asdict(self)
        for name in ("tma", "stream_k_programs", "mask_rows", "block_n_tail"):
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> GemmConfig:
        return config_from_dict(cls, data)


@dataclass(frozen=True, eq=False)  # hashed by identity: the config cache keys on the table
class TunedTable:
    """Configs measured fastest on one card, per (N, K) and tuned M, for 16-bit inputs.

    ``lookup`` takes the entry at the smallest tuned M >= m (the largest tuned M past the end):
    a config tuned at M serves every batch size up to M.
    """

    entries: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]]
    batch_invariant: GemmConfig | None = None
    # Per (N, K): the fastest config without split-K at each tuned M (batch_invariant_tuned).
    no_split_entries: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]] = \
        dataclasses.field(default_factory=dict)

    def lookup(self, m: int, n: int, k: int, dtype: torch.dtype,
               no_split: bool = False) -> GemmConfig | None:
        rows = (self.no_split_entries if no_split else self.entries).get((n, k))
        if not rows or dtype.itemsize != 2:  # tuned in bf16; fp16 has the same tile economics
            return None
        for tuned_m, config in rows:
            if m <= tuned_m:
                return config
        return rows[-1][1]


def load_tuned_table(path: Path | str) -> TunedTable:
    """Parse a tuned file (``{"header", "batch_invariant", "entries": [{m, n, k, config}]}``).

    A missing file gives an empty table; a malformed one raises ValueError naming the path
    (``kernels.utils.load_tuned_json``).
    """
    return load_tuned_json(path, "GEMM tuned table", _parse_tuned_table) or TunedTable(entries={})


def _parse_tuned_table(data: dict) -> TunedTable:
    grouped: dict[tuple[int, int], list[tuple[int, GemmConfig]]] = {}
    no_split: dict[tuple[int, int], list[tuple[int, GemmConfig]]] = {}
    for entry in data["entries"]:
        key, m = (int(entry["n"]), int(entry["k"])), int(entry["m"])
        config = GemmConfig.from_dict(entry["config"])
        if config.stream_k_programs and config.block_m < m:  # it serves every M up to m
            raise ValueError(f"config of ({m}, {key}): stream-K runs one row tile, so block_m "
                             f"must be >= {m}, got {config.block_m}")
        grouped.setdefault(key, []).append((m, config))
        # The tuner records the fastest split_k == 1 candidate as "no_split_config"; older tables
        # only have "config", which serves when it does not split K.
        if "no_split_config" in entry:
            fastest = GemmConfig.from_dict(entry["no_split_config"])
            if not fastest.keeps_k_whole:
                raise ValueError(f"no_split_config of ({m}, {key}) cuts K: split_k "
                                 f"{fastest.split_k}, stream_k_programs "
                                 f"{fastest.stream_k_programs}")
            no_split.setdefault(key, []).append((m, fastest))
        elif config.keeps_k_whole:
            no_split.setdefault(key, []).append((m, config))
    bi = data.get("batch_invariant")

    def by_m(table: dict) -> dict:
        return {key: tuple(sorted(rows, key=lambda r: r[0])) for key, rows in table.items()}

    return TunedTable(entries=by_m(grouped),
                      batch_invariant=GemmConfig.from_dict(bi) if bi else None,
                      no_split_entries=by_m(no_split))


def overlay(base: TunedTable, card: TunedTable) -> TunedTable:
    """``base``'s entries with ``card``'s in place at the same (N, K) and tuned M, both the
    fastest and the fastest-without-split-K rows; ``card``'s portable batch-invariant config
    where it has one, else ``base``'s (a partial table is no sample to pick it from)."""

    def merged(base_rows: dict, card_rows: dict) -> dict:
        out = {key: dict(rows) for key, rows in base_rows.items()}
        for key, rows in card_rows.items():
            out.setdefault(key, {}).update(dict(rows))
        return {key: tuple(sorted(rows.items())) for key, rows in out.items()}

    return TunedTable(entries=merged(base.entries, card.entries),
                      batch_invariant=card.batch_invariant or base.batch_invariant,
                      no_split_entries=merged(base.no_split_entries, card.no_split_entries))


def table_files(card: str | None) -> list[Path]:
    """The files the policy reads on ``card``, base first: the H200's, then the card's own where
    it has one (the interpreter, ``card`` None, reads the H200's)."""
    if card is None or card == BASE_CARD or not tuned_path(card).exists():
        return [TUNED_PATH]
    return [TUNED_PATH, tuned_path(card)]
