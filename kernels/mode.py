"""The three kernel policies every comparison in CoRun runs (DESIGN.md, "Three modes, one engine").

- ``default``: the fastest config per shape, including configs that depend on the batch (split-K
  chosen by M, attention splits chosen from the batch's longest sequence). Not deterministic.
- ``batch_invariant``: one reduction order for every shape (no split-K, a fixed attention split
  size). Deterministic at any batch composition, and slower. The *portable* batch-invariant
  policy: one tile config for every shape, as batch_invariant_ops-style kernels do.
- ``batch_invariant_tuned``: the strongest batch-invariant policy this hardware allows, the peer a
  CoRun speedup must beat. Same scheduling and reduction-order pins as ``batch_invariant`` (no
  split-K, fixed attention split size), but GEMM and MoE tiles (BLOCK_M/N/K, warps, stages,
  persistence) tuned per shape: on the H200 none of those change a row's bits (the MMA
  accumulates K in one order whatever the tile; checked by the GPU tests at real shapes across
  M). Shapes without a tuned entry pin BLOCK_K to the portable policy's, which keeps the bits
  on every backend (the interpreter's depend on BLOCK_K).
- ``corun``: the fastest config per shape, restricted to configs that are position-invariant at a
  fixed shape, plus the selective constraints (fixed decode split size, expert-count-independent
  MoE tiles). Deterministic because the engine fixes the shapes.

A mode is a value passed down to every launcher and config policy, never module state.
"""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    DEFAULT = "default"
    BATCH_INVARIANT = "batch_invariant"
    BATCH_INVARIANT_TUNED = "batch_invariant_tuned"
    CORUN = "corun"

    @property
    def is_batch_invariant(self) -> bool:
        """Every kernel's reduction order is the same at every batch size (either policy)."""
        return self in (Mode.BATCH_INVARIANT, Mode.BATCH_INVARIANT_TUNED)

    @classmethod
    def parse(cls, value: str | Mode, field: str = "mode") -> Mode:
        """Turn a user string into a Mode, raising ValueError that names ``field``."""
        if isinstance(value, Mode):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"{field}: expected one of {choices}, got {value!r}") from None

    def __str__(self) -> str:
        return self.value
