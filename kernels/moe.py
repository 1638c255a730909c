"""Routed mixture of experts: token-to-expert alignment, grouped GEMMs, ordered combine.

Layouts: x [T, H]; w13 [E, 2I, H] (gate rows first, then up, as transformers v5 fuses them);
w2 [E, H, I]; routing weights fp32 [T, k] and expert ids int32 [T, k], rank 0 the best expert.
Numerics are those of ``fused_moe_reference`` in ``kernels/reference.py``. The routers that
produce the weights and ids (``softmax_topk``, ``grouped_topk``) live in ``kernels/moe_routing.py``
and are re-exported here; the jit kernels are in ``kernels/moe_kernels.py``.

Pipeline of ``fused_moe``:
1. ``moe_align_block_size``: the T*k (token, rank) pairs, in token-major order, stably sorted by
   expert id and padded to a multiple of BLOCK_M per expert (vLLM's moe_align_block_size layout).
   Buffer sizes depend only on (T, k, E, BLOCK_M), so the step is CUDA-graph capturable.
2. gate_up grouped GEMM with SiLU-mul fused in the epilogue -> act [T*k, I], one row per pair.
3. down grouped GEMM -> y [T*k, H], one row per pair (no atomics, no scatter-add).
4. combine: out[t] = sum over ranks 0..k-1 of w[t, r] * y[t*k + r] in fp32, cast once.

Invariance. Routers work one token per program, so a token's (weights, ids) are a function of its
own logits in every mode. The grouped GEMMs never split K, and their tile config comes from
``moe_config`` (the total token count and expert shapes, never the per-expert counts), so a
pair's bits do not depend on which other pairs share its expert, nor on where it lands in the
sorted order. Hence, at a fixed T, a token's output is position-invariant in every mode (the
CoRun guarantee, the engine fixes T); under ``batch_invariant`` the config is the same for every T,
so a token's output is also batch-invariant.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.mode import Mode
from kernels.moe_align import moe_align
from kernels.moe_kernels import (
    _moe_combine_kernel,
    _moe_down_kernel,
    _moe_gate_up_kernel,
)
from kernels.moe_routing import MAX_EXPERTS, grouped_topk, softmax_topk
from kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_block_size,
    check_num_warps,
    check_positive_int,
    check_same_device,
    check_shape,
    check_tensor,
    config_from_dict,
    dot_precision,
    is_interpreter,
    load_tuned_json,
    next_power_of_2,
    upcast_dot_operands,
)

__all__ = [
    "MAX_EXPERTS",
    "TUNED_PATH",
    "MoEConfig",
    "MoETunedTable",
    "fallback_moe_config",
    "fused_moe",
    "grouped_topk",
    "load_moe_tuned_table",
    "moe_align_block_size",
    "moe_combine",
    "moe_config",
    "moe_down",
    "moe_gate_up",
    "softmax_topk",
]

TUNED_PATH = Path(__file__).resolve().parent / "tuned" / "moe_h200.json"


@dataclass(frozen=True)
class MoEConfig:
    """Tile config of both expert GEMMs and the combine.

    ``block_m`` is shared (the alignment pads every expert to it); the gate_up GEMM uses
    ``block_n`` (per half), ``block_k``, ``num_warps``, ``num_stages``, and the down GEMM its own
    ``down_*`` fields, which default to the gate_up ones. Each GEMM's BLOCK_K fixes its rows'
    reduction order; every other field changes speed only.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_h: int = 1024  # combine: hidden columns per program (elementwise, order-free)
    down_block_n: int | None = None
    down_block_k: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name.startswith("down_"):
                continue  # the down GEMM shares the gate_up value
            if field.name.endswith("num_warps"):
                check_num_warps(field.name, value)
            elif field.name.endswith("num_stages"):
                check_positive_int(field.name, value)
            else:
                check_block_size(field.name, value)

    def gate_up_meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    def down_meta(self) -> dict:
        own = (self.down_block_n, self.down_block_k, self.down_num_warps, self.down_num_stages)
        meta = self.gate_up_meta()
        for key, value in zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), own, strict=True):
            meta[key] = meta[key] if value is None else value
        return meta

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> MoEConfig:
        return config_from_dict(cls, data)


# ----------------------------------------------------------------------------------------------
# tuned table: kernels/tuned/moe_h200.json, written by experiments/tune_moe.py
# ----------------------------------------------------------------------------------------------

ExpertShape = tuple[int, int, int, int]  # (num_experts, top_k, hidden, intermediate)


@dataclass(frozen=True)
class MoETunedTable:
    """Configs measured fastest on the H200 for 16-bit inputs, keyed by expert shape.

    ``entries[shape]`` holds (tuned total token count, config) sorted by count; ``lookup`` takes
    the smallest tuned count >= num_tokens (the largest past the end). ``batch_invariant[shape]``
    is the one config for every token count. Neither key holds a per-expert count.
    """

    entries: dict[ExpertShape, tuple[tuple[int, MoEConfig], ...]]
    batch_invariant: dict[ExpertShape, MoEConfig]

    def lookup(
        self, num_tokens: int, shape: ExpertShape, batch_invariant: bool
    ) -> MoEConfig | None:
        if batch_invariant:
            return self.batch_invariant.get(shape)
        rows = self.entries.get(shape)
        if not rows:
            return None
        for tuned_tokens, config in rows:
            if num_tokens <= tuned_tokens:
                return config
        return rows[-1][1]


def _shape_key(entry: dict) -> ExpertShape:
    return (int(entry["num_experts"]), int(entry["top_k"]), int(entry["hidden"]),
            int(entry["intermediate"]))


def load_moe_tuned_table(path: Path | str) -> MoETunedTable:
    """Parse a tuned file: ``{"header", "entries": [{num_experts, top_k, hidden, intermediate,
    num_tokens, config}], "batch_invariant": [{<the four shape fields>, config}]}``.

    A missing file gives an empty table (the literal policy); a malformed one raises ValueError
    naming the path (``kernels.utils.load_tuned_json``).
    """
    table = load_tuned_json(path, "MoE tuned table", _parse_tuned_table)
    return table or MoETunedTable(entries={}, batch_invariant={})


def _parse_tuned_table(data: dict) -> MoETunedTable:
    grouped: dict[ExpertShape, dict[int, MoEConfig]] = {}
    for entry in data["entries"]:
        rows = grouped.setdefault(_shape_key(entry), {})
        tokens = int(entry["num_tokens"])
        if tokens < 1 or tokens in rows:
            raise ValueError(f"num_tokens {tokens} invalid or repeated")
        rows[tokens] = MoEConfig.from_dict(entry["config"])
    fixed: dict[ExpertShape, MoEConfig] = {}
    for entry in data.get("batch_invariant") or []:
        key = _shape_key(entry)
        if key in fixed:
            raise ValueError(f"batch_invariant: shape {key} repeated")
        fixed[key] = MoEConfig.from_dict(entry["config"])
    return MoETunedTable(
        entries={key: tuple(sorted(rows.items())) for key, rows in grouped.items()},
        batch_invariant=fixed,
    )


@functools.lru_cache(maxsize=4)
def _tuned_table(path: Path) -> MoETunedTable:
    return load_moe_tuned_table(path)


def fallback_moe_config(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, mode: Mode
) -> MoEConfig:
    """The literal policy, used without tuned data (any dtype, shapes the table does not cover);
    same dependence rules as ``moe_config``."""
    if mode is Mode.BATCH_INVARIANT:
        block_m, block_n, block_k, stages = 32, 64, 64, 4
    elif mode is Mode.BATCH_INVARIANT_TUNED:
        # Tiles by the expected rows per expert, BLOCK_K pinned to the portable policy's.
        rows_per_expert = num_tokens * top_k / max(num_experts, 1)
        block_m, block_n, stages = (16, 64, 3) if rows_per_expert <= 16 else \
            (32, 64, 4) if rows_per_expert <= 64 else (64, 64, 3)
        block_k = 64
    else:
        rows_per_expert = num_tokens * top_k / max(num_experts, 1)
        if rows_per_expert <= 16:  # decode: memory-bound on weights, long K tiles in flight
            block_m, block_n, block_k, stages = 16, 64, 128, 3
        elif rows_per_expert <= 64:
            block_m, block_n, block_k, stages = 32, 64, 64, 4
        else:
            block_m, block_n, block_k, stages = 64, 64, 64, 3
    dim_cap = max(16, next_power_of_2(min(hidden, intermediate)))
    return MoEConfig(
        block_m=block_m,
        block_n=min(block_n, dim_cap),
        block_k=min(block_k, dim_cap),
        num_warps=4,
        num_stages=stages,
        block_h=min(1024, max(16, next_power_of_2(hidden))),
    )


def moe_config(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    mode: Mode = Mode.CORUN,
) -> MoEConfig:
    """Pure policy: tiles from the total token count and expert shapes, never per-expert counts.

    May depend on: ``batch_invariant`` -> expert shapes (E, k, H, I) and dtype only, one config
    for every T; ``default``/``corun`` -> also ``num_tokens`` (vLLM likewise picks from the total
    M); ``batch_invariant_tuned`` -> also ``num_tokens``, through the tuned per-T tiles (the
    expert GEMMs never split K, and on the H200 neither BLOCK_K nor the tile shape changes a
    row's bits, so these are batch-invariant there; checked by
    ``tests/engine/test_gpu_engine.py``), else the literal tiles with BLOCK_K
    pinned, batch-invariant everywhere. For 16-bit dtypes the tuned table
    (kernels/tuned/moe_h200.json, read once, a lookup; no timing at run time) decides when it
    covers the expert shape; otherwise the literal rule on the expected rows per expert
    ``num_tokens * top_k / num_experts``. BLOCK_K can change a row's
    bits (it does in the interpreter); BLOCK_M/N, warps and stages do not. Literal tiles are
    clamped to the expert dims (a shape-only rule) so tiny test shapes stay small.
    """
    mode = Mode.parse(mode)
    if dtype.itemsize == 2:  # tuned in bf16; fp16 has the same tile economics
        # batch_invariant_tuned reads the per-T rows (never split-K, see above).
        tuned = _tuned_table(TUNED_PATH).lookup(
            num_tokens, (num_experts, top_k, hidden, intermediate),
            batch_invariant=mode is Mode.BATCH_INVARIANT)
        if tuned is not None:
            return tuned
    return fallback_moe_config(num_tokens, num_experts, top_k, hidden, intermediate, mode)


# ----------------------------------------------------------------------------------------------
# alignment and the expert GEMMs
# ----------------------------------------------------------------------------------------------


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, rank) pairs by expert, stably, and pad each expert to BLOCK_M rows.

    Returns ``sorted_pair_ids`` int32 [num_blocks * BLOCK_M] (pair = t * k + r; padding holds
    T * k) and ``block_expert_ids`` int32 [num_blocks] (-1 past the last used block). Within an
    expert, pairs keep token-major order. Masked tokens and ids outside [0, E) count toward no
    expert. num_blocks bounds every routing, T*k + min(E, T*k)*(BLOCK_M-1) rows, so no size
    depends on the data (no host sync; graph capturable). Two Triton launches
    (``kernels/moe_align.py``), bit for bit ``moe_align_block_size_reference``.
    """
    return moe_align(topk_ids, num_experts, block_m, token_mask)


def _check_moe_args(
    x, w13, w2, topk_weights, topk_ids, token_mask, check_ids: bool
) -> tuple[int, int, int, int]:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), last_dim_contiguous=True)
    num_experts, two_inter, _ = w13.shape
    if two_inter % 2:
        raise ValueError(f"w13: expected [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")
    inter = two_inter // 2
    check_shape("w13", w13, (-1, -1, hidden))
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), last_dim_contiguous=True)
    check_shape("w2", w2, (num_experts, hidden, inter))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, last_dim_contiguous=True)
    top_k = topk_ids.shape[1]
    check_shape("topk_ids", topk_ids, (num_tokens, -1))
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_ids: top_k {top_k} must be in 1..{num_experts} (experts)")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES,
                 last_dim_contiguous=True)
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    tensors = {"x": x, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    if token_mask is not None:
        check_tensor("token_mask", token_mask, ndim=1, dtypes=(torch.bool,), contiguous=True)
        check_shape("token_mask", token_mask, (num_tokens,))
        tensors["token_mask"] = token_mask
    check_same_device(**tensors)
    # The range check reads the ids on the host: a device sync, which a CUDA graph capture
    # forbids and which stalls the launch queue in eager mode. Skipped while capturing or when the
    # caller opts out (ids straight from softmax_topk/grouped_topk are in range by construction);
    # unchecked out-of-range ids are dropped by moe_align_block_size, never read out of bounds.
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_ids and num_tokens and not capturing:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids: expected ids in [0, {num_experts}), got [{lo}, {hi}]")
    return num_tokens, hidden, inter, num_experts


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    mode: Mode = Mode.CORUN,
    token_mask: torch.Tensor | None = None,
    config: MoEConfig | None = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_r w[t, r] * down_e(silu(gate_e(x_t)) * up_e(x_t)), [T, H].

    ``token_mask`` False marks padding tokens: they count toward no expert and give zeros.
    ``config`` overrides the policy (tests, tuning). ``check_ids=False`` skips the host-side
    range check of ``topk_ids`` (a device sync; always skipped under CUDA graph capture). At a
    fixed T a token's bits do not depend on the other tokens in any mode; under
    ``batch_invariant`` not on T either.
    """
    mode = Mode.parse(mode)
    num_tokens, hidden, inter, num_experts = _check_moe_args(
        x, w13, w2, topk_weights, topk_ids, token_mask, check_ids)
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x)
    if config is not None and not isinstance(config, MoEConfig):
        raise ValueError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if config is None:
        config = moe_config(num_tokens, num_experts, top_k, hidden, inter, x.dtype, mode)
    sorted_pair_ids, block_expert_ids = moe_align_block_size(
        topk_ids, num_experts, config.block_m, token_mask)
    act = moe_gate_up(x, w13, sorted_pair_ids, block_expert_ids, top_k, config)
    y = moe_down(act, w2, sorted_pair_ids, block_expert_ids, config)
    return moe_combine(y, topk_weights, topk_ids, num_experts, config, token_mask)


# ----------------------------------------------------------------------------------------------
# the steps of fused_moe, launched one by one (fused_moe checks the user-facing arguments; the
# tuner times each step alone)
# ----------------------------------------------------------------------------------------------


def _check_alignment(sorted_pair_ids: torch.Tensor, block_expert_ids: torch.Tensor,
                     config: MoEConfig) -> None:
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config: expected a MoEConfig, got {type(config).__name__}")
    if sorted_pair_ids.numel() != block_expert_ids.numel() * config.block_m:
        raise ValueError(f"sorted_pair_ids: {sorted_pair_ids.numel()} rows, expected "
                         f"{block_expert_ids.numel()} blocks x block_m {config.block_m} "
                         f"(aligned with another block_m?)")


def _dot_flags(dtype: torch.dtype) -> dict:
    # SERIAL_DOT: interpreter only (its numpy tl.dot is not row-position-invariant); off on GPUs.
    return {"UPCAST": upcast_dot_operands(dtype), "SERIAL_DOT": is_interpreter(),
            "DOT_PRECISION": dot_precision(dtype)}


def moe_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert_ids: torch.Tensor,
    top_k: int,
    config: MoEConfig,
) -> torch.Tensor:
    """Step 2 of ``fused_moe``: act [T*k, I] = silu(x_t . gate_e) * (x_t . up_e) per pair, from
    ``moe_align_block_size(..., config.block_m)``'s layout. A pair's bits depend on block_k only."""
    _check_alignment(sorted_pair_ids, block_expert_ids, config)
    num_pairs = x.shape[0] * top_k
    hidden, inter = x.shape[1], w13.shape[1] // 2
    meta = config.gate_up_meta()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(block_expert_ids.shape[0], cdiv(inter, meta["BLOCK_N"]))](
        x, w13, act, sorted_pair_ids, block_expert_ids,
        num_pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        TOP_K=top_k, EVEN_K=hidden % meta["BLOCK_K"] == 0, **meta, **_dot_flags(x.dtype),
    )
    return act


def moe_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert_ids: torch.Tensor,
    config: MoEConfig,
) -> torch.Tensor:
    """Step 3 of ``fused_moe``: y [T*k, H] = act[pair] . down_e, one row per pair (no atomics).
    A pair's bits depend on the down block_k only."""
    _check_alignment(sorted_pair_ids, block_expert_ids, config)
    num_pairs, inter = act.shape
    hidden = w2.shape[1]
    meta = config.down_meta()
    y = torch.empty((num_pairs, hidden), dtype=act.dtype, device=act.device)
    _moe_down_kernel[(block_expert_ids.shape[0], cdiv(hidden, meta["BLOCK_N"]))](
        act, w2, y, sorted_pair_ids, block_expert_ids,
        num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        EVEN_K=inter % meta["BLOCK_K"] == 0, **meta, **_dot_flags(act.dtype),
    )
    return y


def moe_combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    config: MoEConfig,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step 4 of ``fused_moe``: out[t] = sum over ranks 0..k-1 (fixed order) of w[t, r] *
    y[t*k + r] in fp32, one cast; masked tokens and out-of-range ids contribute nothing."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    if y.shape[0] != num_tokens * top_k:
        raise ValueError(f"y: expected {num_tokens * top_k} rows (T*k), got {y.shape[0]}")
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=y.device)
    mask_arg = token_mask.view(torch.uint8) if token_mask is not None else y  # y: unused dummy
    _moe_combine_kernel[(num_tokens, cdiv(hidden, config.block_h))](
        y, topk_weights, topk_ids, mask_arg, out,
        hidden, num_experts,
        y.stride(0), topk_weights.stride(0), topk_ids.stride(0), out.stride(0),
        TOP_K=top_k, HAS_MASK=token_mask is not None, BLOCK_H=config.block_h,
    )
    return out
