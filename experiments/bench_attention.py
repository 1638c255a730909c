"""Paged attention on the H200: prefill vs SDPA flash, decode vs the memory bound and SDPA, and
bitwise invariance checks at the real shapes (Qwen3-8B heads: 32 q, 8 kv, head_dim 128, bf16,
cache blocks of 16 tokens scattered at random).

- ``prefill_attention``: one prompt of 512 .. 8192 tokens; peer SDPA flash (GQA), timed the same
  way (target ratio >= 0.8, the attention row of the README).
- ``decode_attention``: batch {1, 8, 32, 64, 128} x context {512 .. 32768}, every sequence at the
  full context; policies ``corun`` (split 256 tokens, grid for max_seq_len = the context) and
  ``default``, ``corun_fused`` (the corun split with the combine done by each sequence's last lane
  in the split launch: one launch, ``DecodeAttentionConfig.fused_combine``, arrival counts held
  across calls), plus ``corun_stages5`` at B <= 8 (the corun split with a 5-stage pipeline: two KV
  tiles in flight behind the block-table load, to show whether the policy's 2 stages starve the few
  programs of a small batch) and ``corun_lanes3`` at B <= 8 where it differs (the corun split over
  as many lanes as fit 3 resident programs an SM, ``DECODE_RESIDENT_PROGRAMS``, rather than about 2
  an SM), and ``corun_bn128_w4`` / ``_w8`` at B <= 8 (128-token KV tiles: half the dependent
  steps of a split). Where the corun policy preloads a lane's block ids
  (``DecodeAttentionConfig.preload_pages``: where they fit ``kernels.utils.MAX_PRELOAD_PAGES``,
  at 3 stages where the grid fits two programs an SM), ``corun_table_ids`` times the loop that
  loads them tile by tile (2 stages, the policy before 2026-12-06) and ``corun_preload_s2`` ..
  ``_s5`` the other stage counts (4 and 5 at B <= 8 only), each with ``same_bits_as_policy``.
  Peer: SDPA with q length 1 over a contiguous cache (flash, else the efficient backend).
  Bound (``bound_us``): K and V read once plus q and out, at the card's measured copy bandwidth
  (harness.copy_bandwidth: 4.3 TB/s on the H200); ``bw_fraction`` = bound_us / us. Issue 13's
  target for B <= 8 is bw_fraction >= 0.6
  (``meets_target``), set where the bound is at least 3 us: below it the fixed cost of the
  split's two graph-replayed launches (split and combine; ``launch_floor_us`` below, 2.0-2.2 us
  on an H100) takes a large share of bound / 0.6 (5 us at a 3 us bound). The target rows also
  carry ``copy_us``:
  torch's device copy of the same bytes, graph-replayed (``harness.copy_reference_us``), and its
  ``copy_bw_fraction`` of the bound: a reference for what one launch moving those bytes reaches
  (half of a copy's bytes are writes, so a kernel that mostly reads can beat it), and
  ``launch_floor_us``: the row's own launches (split, then combine unless fused) with empty
  kernels at the same grids, graph-replayed (``harness.launch_floor_us``); bound / (bound +
  floor) is about the most a kernel of those launches reaches.

Timing: harness.bench_us (CUDA-graph replay medians), ours and the peer the same way.
Run: ``python -m experiments.bench_attention [--quick]`` -> experiments/results/attention-h200.json.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import torch

from experiments.harness import (
    bandwidth_label,
    bench_us,
    copy_reference_us,
    family_main,
    kernel_record,
    launch_floor_us,
    memory_bound_us,
)
from kernels.attention import (
    DECODE_RESIDENT_PROGRAMS,
    DecodeAttentionConfig,
    decode_attention,
    decode_attention_config,
    decode_launch_grids,
    decode_preloaded_pages,
    prefill_attention,
)
from kernels.kv_store import store_kv
from kernels.mode import Mode

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
PREFILL_LENS = (512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128)
DECODE_CONTEXTS = (512, 2048, 4096, 8192, 32768)
MAX_KV_BYTES = 8 * 2**30  # skip decode shapes whose K+V exceed ~8 GB
DECODE_TARGET_BW_FRACTION = 0.6  # issue 13, B <= 8
DECODE_TARGET_MIN_BOUND_US = 3.0  # below this a single launch exceeds bound / 0.6


def _require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_attention needs a CUDA device (the H200); none is available")
    return torch.device("cuda")


def _paged_cache(lens: list[int], seeds: list[int], device: torch.device):
    """Caches with each sequence's blocks scattered (a shuffled block table) and its K/V, drawn
    on the GPU from its own seed, written through store_kv as the engine does. Returns
    (k_cache, v_cache, block_tables, k, v) with k/v the contiguous rows [sum(lens), Hkv, D]."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks, width = max(1, sum(blocks)), max(1, max(blocks))
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=DTYPE, device=device)
    v_cache = torch.zeros(shape, dtype=DTYPE, device=device)
    placement = torch.Generator().manual_seed(sum(seeds) + len(lens))
    perm = torch.randperm(num_blocks, generator=placement).to(torch.int32)
    tables = torch.zeros((len(blocks), width), dtype=torch.int32)
    start = 0
    for b, count in enumerate(blocks):
        tables[b, :count] = perm[start : start + count]
        start += count
    tables = tables.to(device)
    ks, vs, slots = [], [], []
    for b, (n, seed) in enumerate(zip(lens, seeds, strict=True)):
        gen = torch.Generator(device=device).manual_seed(seed)
        ks.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(DTYPE))
        vs.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(DTYPE))
        token = torch.arange(n, device=device)
        slots.append(tables[b, token // BLOCK_SIZE].long() * BLOCK_SIZE + token % BLOCK_SIZE)
    k, v = torch.cat(ks), torch.cat(vs)
    del ks, vs
    store_kv(k, v, k_cache, v_cache, torch.cat(slots))
    return k_cache, v_cache, tables, k, v


def _queries(seeds: list[int], device: torch.device) -> torch.Tensor:
    """One decode query [Hq, D] per sequence, each from its own seed -> [B, Hq, D]."""
    rows = [torch.randn(NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(s + 1))
            for s in seeds]
    return torch.stack(rows).to(device, DTYPE)


def _sdpa(q, k, v, backend, is_causal):
    """SDPA on contiguous [B, H, L, D]; GQA through enable_gqa, else K/V repeated beforehand."""
    from torch.nn.attention import sdpa_kernel

    group = q.shape[1] // k.shape[1]
    try:
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                             enable_gqa=True)

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, enable_gqa=True)
        return run, "enable_gqa"
    except RuntimeError:
        k_rep = k.repeat_interleave(group, dim=1)
        v_rep = v.repeat_interleave(group, dim=1)

        def run_rep():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k_rep, v_rep, is_causal=is_causal)
        run_rep()  # raises if this backend cannot run the shape at all
        return run_rep, "repeat_interleave"


def prefill_case(length: int, device: torch.device):
    """One prompt of ``length`` tokens in a scattered paged cache: (ours, peer, how the peer does
    GQA); ``ours`` runs the corun prefill, ``peer`` SDPA flash on the contiguous K/V."""
    from torch.nn.attention import SDPBackend

    k_cache, v_cache, tables, k, v = _paged_cache([length], [length], device)
    gen = torch.Generator(device=device).manual_seed(length + 1)
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device).to(DTYPE)
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    ctx = torch.tensor([length], dtype=torch.int32, device=device)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    peer_fn, gqa = _sdpa(q4, k4, v4, SDPBackend.FLASH_ATTENTION, is_causal=True)

    def ours() -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, tables, cu, ctx, SCALE, max_q_len=length,
                                 mode=Mode.CORUN)  # fmt: skip
    return ours, peer_fn, gqa


def _bench_prefill(length: int, device: torch.device) -> dict:
    ours, peer_fn, gqa = prefill_case(length, device)
    us = bench_us(ours)
    peer_us = bench_us(peer_fn)
    flops = 2 * 2 * NUM_Q_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal: half the scores
    return kernel_record(
        "prefill_attention", "corun", length, NUM_Q_HEADS, HEAD_DIM, DTYPE, us,
        "sdpa_flash", peer_us, peer_gqa=gqa, tflops=round(flops / us / 1e6, 1),
        num_kv_heads=NUM_KV_HEADS, target_ratio=0.8,
    )


class _Variant(NamedTuple):
    """A decode row: its name, mode, config (None: the mode's policy) and whether its output is
    checked against the policy's bits (``same_bits_as_policy``: variants that change speed only)."""

    name: str
    mode: Mode
    config: DecodeAttentionConfig | None = None
    same_bits: bool = False


def _bench_decode(batch: int, context: int, device: torch.device) -> list[dict]:
    from torch.nn.attention import SDPBackend

    seeds = [batch * 100003 + context * 7 + b for b in range(batch)]
    k_cache, v_cache, tables, k, v = _paged_cache([context] * batch, seeds, device)
    q = _queries(seeds, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    kv_bytes = 2 * k.numel() * k.element_size()
    moved_bytes = kv_bytes + 2 * q.numel() * q.element_size()  # K, V, q in and out
    bound = memory_bound_us(moved_bytes)
    # Peer: SDPA with q len 1 over a contiguous cache (flash, else the efficient backend).
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    k4 = k.view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v4 = v.view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    del k, v
    peer_name, peer_fn, gqa = None, None, None
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            peer_fn, gqa = _sdpa(q4, k4, v4, backend, is_causal=False)
            peer_name = name
            break
        except RuntimeError:
            continue
    peer_us = bench_us(peer_fn) if peer_fn is not None else 0.0  # ratio 0: no peer ran
    targeted = batch <= 8 and bound >= DECODE_TARGET_MIN_BOUND_US
    # The target rows' reference in practice: torch's device copy of the same bytes, graph-replayed.
    copy_us = copy_reference_us(moved_bytes) if targeted else None
    corun_cfg = decode_attention_config(batch, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, context,
                                        DTYPE, Mode.CORUN)
    policies = [_Variant("corun", Mode.CORUN), _Variant("default", Mode.DEFAULT),
                _Variant("corun_fused", Mode.CORUN,
                         dataclasses.replace(corun_cfg, fused_combine=True))]
    if batch <= 8:
        policies.append(_Variant("corun_stages5", Mode.CORUN, dataclasses.replace(
            corun_cfg, num_stages=5, preload_pages=False)))
        # The same splits over lanes sized to the programs an H200 holds at once (3 an SM)
        # rather than two per SM: fewer rounds of splits per lane where the split count allows.
        lanes = max(1, min(corun_cfg.max_num_splits,
                           DECODE_RESIDENT_PROGRAMS // (batch * NUM_KV_HEADS)))
        if lanes != corun_cfg.num_split_programs:
            policies.append(_Variant("corun_lanes3", Mode.CORUN, dataclasses.replace(
                corun_cfg, num_split_programs=lanes, preload_pages=False, num_stages=2)))
        # Half the dependent steps a split takes (a small batch's programs walk their splits
        # one latency-bound KV tile after another: B = 1 takes 11.6-12.5 us from 512 to 4096
        # tokens on an H100), with 4 and 8 warps; other bits than the 64-token policy's, and as
        # fixed.
        for warps in (4, 8):
            policies.append(_Variant(f"corun_bn128_w{warps}", Mode.CORUN, dataclasses.replace(
                corun_cfg, BLOCK_N=128, num_warps=warps, num_stages=2, preload_pages=False)))
    if corun_cfg.preload_pages:
        # The policy's preloaded block ids against the loop that loads them tile by tile (its
        # 2 stages: one K and one V buffer, waited for every step) and at the other stage counts:
        # speed only, the same bits. Compiled for sm_90a, n stages keep n - 2 tiles in flight
        # behind the one being computed (cp.async.wait_group 2 (n - 2)), and a small batch's
        # program, alone on its SM, moves about a tile a round trip: 4 and 5 stages at B <= 8
        # (110 and 143 KB of shared memory, one program an SM) keep two and three in flight.
        stages = (2, 3, 4, 5) if batch <= 8 else (2, 3)
        policies.append(_Variant("corun_table_ids", Mode.CORUN, dataclasses.replace(
            corun_cfg, preload_pages=False, num_stages=2), same_bits=True))
        policies += [_Variant(f"corun_preload_s{n}", Mode.CORUN, dataclasses.replace(
                         corun_cfg, num_stages=n), same_bits=True)
                     for n in stages if n != corun_cfg.num_stages]
    # The fused combine's arrival counts, held across calls as an engine would (no memset).
    arrivals = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device=device)
    records = []
    policy_out = None
    floors: dict[tuple, float] = {}  # launch_floor_us by (grids, warps): variants share grids
    for policy, mode, override, same_bits in policies:
        # corun: the engine's max_model_len; here the context itself (the grid bound only).
        cfg = override or decode_attention_config(batch, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                                  context, DTYPE, mode)

        def run(mode=mode, override=override) -> torch.Tensor:
            return decode_attention(q, k_cache, v_cache, tables, seq_lens, SCALE,
                                    max_seq_len=context, mode=mode, config=override,
                                    arrivals=arrivals)

        us = bench_us(run)
        extra = {}
        if policy == "corun":
            policy_out = run()
        elif same_bits:  # speed only: the same bits as the policy, checked here
            extra = {"same_bits_as_policy": bool(torch.equal(run(), policy_out))}
        if cfg.preload_pages:
            extra["lane_pages"] = decode_preloaded_pages(cfg, BLOCK_SIZE)
        launches = decode_launch_grids(cfg, batch, NUM_Q_HEADS, NUM_KV_HEADS)
        if targeted:
            # The fixed cost of this row's launches whatever their kernels do (empty kernels,
            # each at the split's warps); with the bytes at the bound on top, the least it takes.
            key = (tuple(launches), cfg.num_warps)
            if key not in floors:
                floors[key] = launch_floor_us(launches, num_warps=cfg.num_warps)
            extra["launch_floor_us"] = round(floors[key], 3)
        fraction = bound / us
        records.append(kernel_record(
            "decode_attention", policy, batch, NUM_Q_HEADS, HEAD_DIM, DTYPE, us,
            peer_name or "none", peer_us, context=context, num_kv_heads=NUM_KV_HEADS,
            peer_gqa=gqa, kv_bytes=kv_bytes, bound_us=round(bound, 3),
            bw_fraction=round(fraction, 4), split_size=cfg.split_size,
            num_splits=cfg.max_num_splits, lanes=cfg.num_split_programs,
            num_stages=cfg.num_stages,
            launches=len(launches),
            bound_assumes=f"K + V + q + out bytes once at {bandwidth_label()}",
            target=f"bw_fraction >= {DECODE_TARGET_BW_FRACTION}" if targeted else None,
            meets_target=(fraction >= DECODE_TARGET_BW_FRACTION) if targeted else None,
            **({"copy_us": round(copy_us, 3), "copy_bw_fraction": round(bound / copy_us, 4)}
               if copy_us else {}),
            **extra,
        ))
    return records


def collect(quick: bool = False) -> list[dict]:
    """Timing records: prefill vs SDPA flash; decode (corun, default) vs bound and SDPA."""
    device = _require_cuda()
    torch.manual_seed(0)
    records = []
    for length in (512, 4096) if quick else PREFILL_LENS:
        records.append(_bench_prefill(length, device))
        torch.cuda.empty_cache()
    batches = (1, 64) if quick else DECODE_BATCHES
    contexts = (4096,) if quick else DECODE_CONTEXTS
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
            if kv_bytes > MAX_KV_BYTES:
                continue
            records.extend(_bench_decode(batch, context, device))
            torch.cuda.empty_cache()
    return records


def _diff_count(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def _decode_row(device, own, others, slot, mode, max_seq_len) -> torch.Tensor:
    """Decode output of the sequence ``own`` = (seed, length) placed at ``slot`` among
    ``others`` (a list of (seed, length)); every sequence's data comes from its own seed."""
    seqs = list(others)
    seqs.insert(slot, own)
    seeds, lens = [s for s, _ in seqs], [n for _, n in seqs]
    k_cache, v_cache, tables, _, _ = _paged_cache(lens, seeds, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = decode_attention(_queries(seeds, device), k_cache, v_cache, tables, seq_lens, SCALE,
                           max_seq_len=max_seq_len, mode=mode)
    return out[slot].clone()


def check_invariance_gpu() -> list[dict]:
    """Bitwise checks in bf16 at Qwen3-8B heads: decode row vs co-runners per mode, prefill whole
    vs chunked."""
    device = _require_cuda()
    results = []
    gen = torch.Generator().manual_seed(1)
    # Batch 8: small enough that default mode splits a 3000-token sequence several times.
    own, batch, max_model_len, slot_b = (11, 3000), 8, 8192, 5
    set_a = [(100 + i, int(n)) for i, n in enumerate(torch.randint(0, 2000, (batch - 1,),
                                                                   generator=gen))]
    set_b = [(500 + i, int(n)) for i, n in enumerate(torch.randint(0, 8192, (batch - 1,),
                                                                   generator=gen))]
    shape = f"B={batch} Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} own_len={own[1]}"
    for mode in (Mode.CORUN, Mode.BATCH_INVARIANT, Mode.DEFAULT):
        if mode == Mode.DEFAULT:  # default passes the batch's longest as the grid bound
            max_a = max([own[1]] + [n for _, n in set_a])
            max_b = max([own[1]] + [n for _, n in set_b])
        else:
            max_a = max_b = max_model_len
        a = _decode_row(device, own, set_a, 0, mode, max_a)
        b = _decode_row(device, own, set_b, slot_b, mode, max_b)
        diff = _diff_count(a, b)
        if mode == Mode.DEFAULT:
            results.append({
                "op": "decode_attention", "check": "negative_control_co_runners_change_bits",
                "mode": mode.value, "shape": shape, "passed": diff > 0,
                "detail": f"{diff} of {a.numel()} elements differ (expected > 0: default splits "
                          f"follow the batch's longest sequence, {max_a} vs {max_b})",
            })
        else:
            results.append({
                "op": "decode_attention", "check": "row_independent_of_co_runners_and_slot",
                "mode": mode.value, "shape": shape, "passed": diff == 0,
                "detail": f"{diff} of {a.numel()} elements differ (slot 0 vs {slot_b}, other "
                          f"lengths and contents changed)",
            })
    results += _one_split_check(device) + _packed_prefill_check(device) + _graph_check(device)
    results += _fused_combine_check(device)
    length = 4096
    whole = _prefill_chunked(device, length, length)
    for chunk, promised in ((1024, True), (512, True), (1000, False)):
        chunked = _prefill_chunked(device, length, chunk)
        diffs = [_diff_count(x, y) for x, y in zip(whole, chunked, strict=True)]
        results.append({
            "op": "prefill_attention",
            "check": "whole_vs_chunked" if promised else "whole_vs_chunked_unaligned_informational",
            "mode": Mode.CORUN.value, "shape": f"L={length} C={chunk} Hq={NUM_Q_HEADS} "
                                               f"Hkv={NUM_KV_HEADS} D={HEAD_DIM}",
            "passed": all(d == 0 for d in diffs),
            "detail": f"differing elements (out, k, v): {diffs}"
                      + ("" if promised else "; C not a multiple of BLOCK_M: not promised"),
        })
    return results


def _fused_combine_check(device, repeats: int = 50) -> list[dict]:
    """The fused combine (last lane of each sequence and kv head combines) against the two-launch
    path, bit for bit, ``repeats`` times in a row (an ordering bug would show as an occasional
    difference), mixed lengths with fewer lanes than splits and more, and one held arrivals
    buffer left at zero after every call."""
    lens = [4096, 3000, 0, 200, 256, 257, 8000, 1]
    seeds = [700 + i for i in range(len(lens))]
    k_cache, v_cache, tables, _, _ = _paged_cache(lens, seeds, device)
    q = _queries(seeds, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    arrivals = torch.zeros(len(lens) * NUM_KV_HEADS, dtype=torch.int32, device=device)
    records = []
    for lanes in (3, 64):
        cfg = dataclasses.replace(
            decode_attention_config(len(lens), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 8192, DTYPE,
                                    Mode.CORUN), num_split_programs=lanes)
        run = lambda cfg: decode_attention(  # noqa: E731
            q, k_cache, v_cache, tables, seq_lens, SCALE, max_seq_len=8192, config=cfg,
            arrivals=arrivals)
        two = run(cfg)
        fused_cfg = dataclasses.replace(cfg, fused_combine=True)
        diffs = [_diff_count(run(fused_cfg), two) for _ in range(repeats)]
        torch.cuda.synchronize()
        left = int(arrivals.count_nonzero())
        records.append({
            "op": "decode_attention", "check": "fused_combine_equals_two_launches",
            "mode": Mode.CORUN.value, "shape": f"B=8 lens {lens} split 256, {lanes} lanes",
            "passed": not any(diffs) and left == 0,
            "detail": f"{sum(d > 0 for d in diffs)} of {repeats} calls differ (most elements "
                      f"{max(diffs)}); {left} arrival counts left nonzero",
        })
    return records


def _one_split_check(device) -> list[dict]:
    """A 200-token sequence (one 256-token split): alone with the grid bound at the split size
    (stage 1 only, one launch) vs at slot 3 of 8 beside long co-runners with the grid bound 8192
    (stage 1 + combine)."""
    own, others = (21, 200), [(600 + i, 7000 - 500 * i) for i in range(7)]
    shape = "B=8 own_len=200 split=256 max_seq_len 256 vs 8192"
    records = []
    for mode in (Mode.CORUN, Mode.BATCH_INVARIANT):
        a = _decode_row(device, own, [], 0, mode, 256)
        b = _decode_row(device, own, others, 3, mode, 8192)
        diff = _diff_count(a, b)
        records.append({
            "op": "decode_attention", "check": "one_split_sequence_one_or_two_launches",
            "mode": mode.value, "shape": shape, "passed": diff == 0,
            "detail": f"{diff} of {a.numel()} elements differ",
        })
    return records


def _packed_prefill_check(device) -> list[dict]:
    """A 1000-token chunk (of a 1100-token context) prefilled alone vs packed into one step after
    a 300-token chunk and a zero-length padding row, with 77 padding tokens after the last
    sequence; the padding rows must be zeros."""
    lens, seeds, chunk = [300, 0, 1100], [31, 32, 33], 1000
    k_cache, v_cache, tables, _, _ = _paged_cache(lens, seeds, device)
    gen = torch.Generator(device=device).manual_seed(34)
    q = torch.randn(300 + chunk + 77, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device)
    q = q.to(DTYPE)
    i32 = dict(dtype=torch.int32, device=device)
    cu = torch.tensor([0, 300, 300, 1300], **i32)
    packed = prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor(lens, **i32), SCALE,
                               max_q_len=chunk, mode=Mode.CORUN)
    alone = prefill_attention(q[300:1300].contiguous(), k_cache, v_cache, tables[2:].contiguous(),
                              torch.tensor([0, chunk], **i32), torch.tensor([1100], **i32), SCALE,
                              max_q_len=chunk, mode=Mode.CORUN)
    diff = _diff_count(packed[300:1300], alone)
    zero = bool((packed[1300:] == 0).all())
    shape = "chunk 1000 of 1100 after 300 + a zero-length row, 77 padding tokens"
    return [
        {"op": "prefill_attention", "check": "packed_rows_equal_alone", "mode": "corun",
         "shape": shape, "passed": diff == 0, "detail": f"{diff} of {alone.numel()} differ"},
        {"op": "prefill_attention", "check": "packed_padding_rows_zero", "mode": "corun",
         "shape": shape, "passed": zero, "detail": "padding rows exactly 0" if zero else "nonzero"},
    ]


def _graph_check(device) -> list[dict]:
    """The packed prefill launch on GPU tensors records into a CUDA graph (no host sync)."""
    from experiments.bench_mla import _capturable

    lens = [200, 0, 90]
    k_cache, v_cache, tables, _, _ = _paged_cache(lens, [41, 42, 43], device)
    q = torch.randn(260, NUM_Q_HEADS, HEAD_DIM, device=device).to(DTYPE)
    i32 = dict(dtype=torch.int32, device=device)
    cu, ctx = torch.tensor([0, 150, 150, 240], **i32), torch.tensor(lens, **i32)
    ok, detail = _capturable(lambda: prefill_attention(q, k_cache, v_cache, tables, cu, ctx,
                                                       SCALE, max_q_len=150))
    return [{"op": "prefill_attention", "check": "cuda_graph_capturable", "mode": "corun",
             "shape": "packed: 150 + 0 + 90 of 260 rows", "passed": ok, "detail": detail}]


def summarize(records: list[dict]) -> None:
    """Print the decode rows at B <= 8 (issue 13's target) and the prefill ratios."""
    print(f"{'op':17s} {'policy':14s} {'B':>4s} {'ctx':>6s} {'us':>9s} {'peer_us':>9s} "
          f"{'bound_us':>9s} {'bw_frac':>7s} {'target':>7s}")
    for r in records:
        if r["op"] == "decode_attention" and r["M"] > 8:
            continue
        mark = {True: "met", False: "MISSED", None: "-"}[r.get("meets_target")]
        print(f"{r['op']:17s} {r['policy']:14s} {r['M']:4d} {r.get('context') or 0:6d} "
              f"{r['us']:9.1f} {r['peer_us']:9.1f} {r.get('bound_us') or 0:9.2f} "
              f"{r.get('bw_fraction') or 0:7.3f} {mark:>7s}  ratio {r['ratio']}")
    targeted = [r for r in records if r.get("meets_target") is not None]
    print(f"attention targets met: {sum(bool(r['meets_target']) for r in targeted)} of "
          f"{len(targeted)}")


def _prefill_chunked(device, length: int, chunk: int):
    """Prefill one prompt in chunks of ``chunk`` (whole if chunk >= length); returns the output
    rows and the prompt's K/V read back from the cache."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device, DTYPE)
    k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, DTYPE)
    v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, DTYPE)
    num_blocks = -(-length // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    junk = torch.Generator().manual_seed(chunk)  # unwritten slots differ between the runs
    k_cache = torch.randn(shape, generator=junk).to(device, DTYPE)
    v_cache = torch.randn(shape, generator=junk).to(device, DTYPE)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    table = table.to(torch.int32).view(1, -1).to(device)
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        token = torch.arange(start, end, device=device)
        slots = table[0, token // BLOCK_SIZE].long() * BLOCK_SIZE + token % BLOCK_SIZE
        store_kv(k[start:end], v[start:end], k_cache, v_cache, slots)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        ctx = torch.tensor([end], dtype=torch.int32, device=device)
        outs.append(prefill_attention(q[start:end], k_cache, v_cache, table, cu, ctx, SCALE,
                                      max_q_len=end - start, mode=Mode.CORUN))
    token = torch.arange(length, device=device)
    rows = table[0, token // BLOCK_SIZE].long(), token % BLOCK_SIZE
    return torch.cat(outs), k_cache[rows], v_cache[rows]


def main(argv: list[str] | None = None) -> int:
    return family_main("attention", collect, check_invariance_gpu, argv, __doc__.splitlines()[0],
                       summarize)


if __name__ == "__main__":
    sys.exit(main())
