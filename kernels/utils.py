"""Small helpers shared by the kernel launchers: argument checks, interpreter detection, config
field checks, the tuned-table file reader and the card a device's tables are named after."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

T = TypeVar("T")


def is_interpreter() -> bool:
    """True when Triton runs kernels through its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def card_name(device_name: str) -> str:
    """``h200`` / ``h100`` for those NVIDIA cards, another GPU's name in lower case with dashes."""
    for tag in ("H200", "H100"):  # not the Grace Hopper superchips' (GH200: other memory)
        if tag in device_name and f"G{tag}" not in device_name:
            return tag.lower()
    return device_name.lower().replace(" ", "-")


@functools.cache
def _cuda_card(index: int) -> str:
    return card_name(torch.cuda.get_device_name(index))


def device_card(device: torch.device) -> str | None:
    """The card a CUDA device's tuned tables and results are named after (``card_name``); None
    for any other device (the CPU interpreter)."""
    if device.type != "cuda":
        return None
    return _cuda_card(torch.cuda.current_device() if device.index is None else device.index)


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Whether bf16 tiles must be upcast to fp32 before ``tl.dot``.

    The interpreter (triton 3.9, numpy backed) returns garbage for bf16 ``tl.dot`` while fp16 and
    fp32 are exact (DESIGN.md, "Testing where there is no GPU"). On a GPU this is always False, so
    it never changes the reduction order there.
    """
    return is_interpreter() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 operands would otherwise run as tf32 on the GPU; 16-bit
    operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def is_host_checkable(tensor: torch.Tensor) -> bool:
    """Whether data-dependent checks (lengths, slots) may read ``tensor`` on the host: only on the
    CPU, where that costs no device sync, so a launch under CUDA-graph capture never syncs."""
    return tensor.device.type == "cpu"


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether a Hopper TMA descriptor can cover ``t``: unit stride along the last dim, a 16-byte
    aligned base, and every other stride positive (not an expanded dim) and 16-byte aligned."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]))


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one launcher argument; raise ValueError naming it and what was expected.

    On every launch path (about a microsecond a call, ~1,200 calls an eager forward): the
    passing case does one attribute read per requested check and builds no message.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({allowed}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {tensor.stride()})")
    if last_dim_contiguous and tensor.ndim and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected stride 1 in the last dim, got strides {tensor.stride()}"
        )
    return tensor


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it. ValueError names the odd one out."""
    items = iter(tensors.items())
    first_name, first = next(items)
    device = first.device
    for name, tensor in items:
        if tensor.device != device:
            raise ValueError(
                f"{name}: expected device {device} (as {first_name}), got {tensor.device}"
            )
    return device


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """Exact shape check; -1 in ``expected`` matches any size."""
    shape = tensor.shape
    if len(shape) == len(expected):
        for size, want in zip(shape, expected, strict=True):
            if want != size and want != -1:
                break
        else:
            return
    want = tuple("*" if e == -1 else e for e in expected)
    raise ValueError(f"{name}: expected shape {want}, got {tuple(shape)}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# The most block ids a decode program loads before its token loop (MLA's and decode attention's
# ``preload_pages``): a span of more pages loads its ids tile by tile instead (a power of two, as
# tl.arange is).
MAX_PRELOAD_PAGES = 64


def preload_page_count(span_tokens: int, page_size: int, page_aligned: bool) -> int:
    """Block ids a program preloads for a run of at most ``span_tokens`` consecutive tokens: a
    power of two covering every page the run can touch (one more when it may start inside a page,
    ``page_aligned`` false), or 0 past MAX_PRELOAD_PAGES (ids then loaded tile by tile)."""
    pages = next_power_of_2(cdiv(span_tokens, page_size) + (0 if page_aligned else 1))
    return pages if pages <= MAX_PRELOAD_PAGES else 0


# ----------------------------------------------------------------------------------------------
# launch configs and their tuned tables (kernels/tuned/<op>_<device>.json)
# ----------------------------------------------------------------------------------------------


def check_block_size(name: str, value: object) -> None:
    """A tile size: a power of two >= 16 (the smallest tl.dot operand)."""
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= 16, got {value!r}")


def check_num_warps(name: str, value: object) -> None:
    if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}: expected 1, 2, 4, 8 or 16, got {value!r}")


def check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def check_softmax_scale(value: object) -> float:
    """The attention launchers' ``scale``: a finite number > 0 (the kernels take the row max of the
    raw scores and scale it once, which is the max of the scaled scores only for a positive
    scale); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"scale: expected a finite number > 0, got {value!r}")
    return float(value)


def config_from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build the frozen config dataclass ``cls`` from a tuned file's ``config`` object; unknown
    fields raise ValueError (a typo must not silently fall back to a default)."""
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"config: unknown fields {sorted(unknown)}")
    return cls(**data)


def load_tuned_json(path: Path | str, what: str, parse: Callable[[dict], T]) -> T | None:
    """Read a tuned table ``{"header": {...}, "entries": [...], ...}`` and ``parse`` it.

    A missing file gives None (the caller's literal policy applies). A file that is not JSON, not
    an object with an ``entries`` list, or that ``parse`` rejects (KeyError, TypeError,
    ValueError, AttributeError) raises ValueError naming the path and ``what``: a silent fallback
    would change which configs, and so which bits, the engine runs. Callers cache the result.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError("expected an object with an 'entries' list")
        return parse(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # JSONDecodeError included
        raise ValueError(f"{path}: malformed {what} ({err})") from err


def check_block_ids(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                     num_blocks: int) -> None:
    """CPU only: the blocks each sequence uses exist in the cache."""
    for b, length in enumerate(lengths.tolist()):
        used = block_tables[b, : cdiv(int(length), block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"block_tables: row {b} points outside the cache "
                             f"(ids must lie in [0, {num_blocks}))")
