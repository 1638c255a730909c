"""The three kernel policies every comparison in CoRun runs (DESIGN.md, "Three modes, one engine").

- ``default``: the fastest config per shape, including configs that depend on the batch (split-K
  chosen by M, attention splits chosen from the batch's longest sequence). Not deterministic.
- ``batch_invariant``: one reduction order for every shape (no split-K, a fixed attention split
  size). Deterministic at any batch composition, and slower.
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
    CORUN = "corun"

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
