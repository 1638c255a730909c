"""Triton kernels of ``kernels/sampling.py`` (the algorithm and its invariance are described there).

Order keys: a scaled logit's fp32 bits with the negative patterns flipped, so integer order is
float order (-0.0 sorts just below +0.0, NaNs beyond the infinities); the map is an involution,
so a key gives its float back exactly. Masses are fixed point: a token's mass is
``int64(exp(s - s_max) * 2**40)``, and every sum of masses is an integer sum, the same bits in any
order. Workspace layout per row and chunk ("part" = row * num_chunks + chunk): see the launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The largest fp32 below 1 (1 - 2**-24): the top 24-bit word, centred, rounds to 1.0 in fp32, whose
# Gumbel noise -log(-log(u)) is +inf and would pick its token whatever the logits.
U_MAX = tl.constexpr(0.99999994039535522)
MASS_ONE = tl.constexpr(1099511627776.0)  # 2**40: the fixed-point unit of a token's mass
KEY_FLOOR = tl.constexpr(-(1 << 40))  # below every int32 order key: "no bound" / "keep all"


@triton.jit
def _philox_uniform(offs, position, sample_index, seed):
    """u in (0, 1) for vocab indices ``offs``: Philox4x32-10 word 0, top 24 bits, centred, at most
    ``U_MAX``."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = offs.to(tl.uint32)
    zeros = tl.zeros_like(c0)
    c1 = zeros + position.to(tl.uint32)
    c2 = zeros + sample_index.to(tl.uint32)
    c3 = zeros
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return tl.minimum(((c0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), U_MAX)


@triton.jit
def _minus_max(s, s_max):
    """s - s_max, with a -inf max read as 0 (an all -inf row or piece: -inf, never NaN)."""
    return s - tl.where(s_max > float("-inf"), s_max, 0.0)


@triton.jit
def _fixed_mass(s, s_max):
    """int64(exp(s - s_max) * 2**40), 0 for -inf and NaN, 2**40 at the max (also when it is inf)."""
    e = tl.exp(_minus_max(s, s_max))
    e = tl.minimum(tl.where(e == e, e, 0.0), 1.0)
    e = tl.where(s == s_max, 1.0, e)
    return (e * MASS_ONE).to(tl.int64)


@triton.jit
def _row_params(temperature_ptr, top_k_ptr, top_p_ptr, row, vocab):
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    is_greedy = temperature == 0.0
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    do_top_k = (top_k > 0) & (top_k < vocab) & (temperature != 0.0)
    do_top_p = (top_p < 1.0) & (temperature != 0.0)
    return temperature, is_greedy, top_k, top_p, do_top_k, do_top_p


@triton.jit
def _sample_partial_kernel(
    # pointers
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    sample_indices_ptr,
    positions_ptr,
    ws_f32_ptr,
    ws_i32_ptr,
    ws_i64_ptr,
    # sizes
    vocab,
    num_chunks,
    num_parts,
    # strides
    stride_logits_b,
    # meta
    CHUNK: tl.constexpr,
    R: tl.constexpr,
    PIECES: tl.constexpr,
):
    """PIECES consecutive fixed pieces of CHUNK columns of one row, each reduced alone: a greedy or
    Gumbel-max partial argmax per piece, or (top-k / top-p rows) each piece's candidate list, its
    bound, its max and the mass of the rest. How many pieces a program reads changes no partial."""
    row = tl.program_id(0).to(tl.int64)
    first_chunk = tl.program_id(1).to(tl.int64) * PIECES
    temperature, is_greedy, top_k, top_p, do_top_k, do_top_p = _row_params(
        temperature_ptr, top_k_ptr, top_p_ptr, row, vocab)
    position = tl.load(positions_ptr + row)
    sample_index = tl.load(sample_indices_ptr + row)
    seed = tl.load(seeds_ptr + row)
    if do_top_k | do_top_p:
        for piece in range(PIECES):
            chunk = first_chunk + piece
            if chunk < num_chunks:
                _piece_candidates(logits_ptr + row * stride_logits_b, ws_f32_ptr, ws_i32_ptr,
                                  ws_i64_ptr, row * num_chunks + chunk, chunk, vocab, num_parts,
                                  temperature, position, sample_index, seed, CHUNK, R)
    else:
        # Greedy and temperature-only rows: one [PIECES, CHUNK] tile, an argmax per piece (its
        # max is exact and its ties go to the lowest id, so the tile shape changes no bits).
        chunks = first_chunk + tl.arange(0, PIECES)
        cols = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_logits_b + cols, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        if is_greedy:
            val = tl.where(mask, x, float("-inf"))
        else:
            s = tl.math.div_rn(x, tl.zeros([PIECES, CHUNK], tl.float32)
                               + tl.maximum(temperature, 1e-6))
            u = _philox_uniform(cols, position, sample_index, seed)
            val = tl.where(mask, s - tl.log(-tl.log(u)), float("-inf"))
        best, at = tl.max(val, axis=1, return_indices=True, return_indices_tie_break_left=True)
        parts = row * num_chunks + chunks
        in_row = chunks < num_chunks
        tl.store(ws_f32_ptr + parts, best, mask=in_row)
        # (NaN logits make the argmax arbitrary: keep the id inside the vocab at least)
        tl.store(ws_i32_ptr + parts, tl.minimum(chunks * CHUNK + at, vocab - 1).to(tl.int32),
                 mask=in_row)


@triton.jit
def _piece_candidates(
    row_ptr, ws_f32_ptr, ws_i32_ptr, ws_i64_ptr, part, chunk, vocab, num_parts, temperature,
    position, sample_index, seed, CHUNK: tl.constexpr, R: tl.constexpr,
):
    """One piece of a top-k / top-p row: its candidate list (the largest top set of at most R
    tokens) with their Gumbel values, its max, its completeness bound and the mass of the rest."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, tl.zeros([CHUNK], tl.float32) + tl.maximum(temperature, 1e-6))
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key64 = key.to(tl.int64)
    s_max_c = tl.max(s, axis=0)
    key_hi = tl.max(tl.where(mask, key, -2147483648), axis=0)
    key_lo = tl.min(tl.where(mask, key, 2147483647), axis=0)
    n_valid = tl.sum(mask.to(tl.int32), axis=0)
    # The list: the largest top set {key >= b} with at most R members. Bisection on b:
    # count(lo) > R >= count(hi); exactly R members pins the set at once.
    lo = key_lo.to(tl.int64)
    hi = tl.where(n_valid > R, key_hi.to(tl.int64) + 1, lo + 1)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        count = tl.sum((mask & (key >= mid.to(tl.int32))).to(tl.int32), axis=0)
        fits = count <= R
        hi = tl.where(fits, mid, hi)
        lo = tl.where(count == R, mid - 1, tl.where(fits, lo, mid))
    # (tl.where, not `| scalar`: the interpreter cannot OR a tile with a scalar bool)
    in_list = tl.where(n_valid <= R, mask, mask & (key64 >= hi))
    rest = mask & ~in_list
    # Completeness bound: the list holds every element with key >= bound.
    bound = tl.max(tl.where(rest, key64, KEY_FLOOR - 1), axis=0) + 1
    e = tl.exp(_minus_max(s, s_max_c))
    e = tl.where(rest & (e == e), e, 0.0)
    slot = tl.cumsum(in_list.to(tl.int32), axis=0) - 1
    n_list = tl.sum(in_list.to(tl.int32), axis=0)
    cand = part * R + slot
    tl.store(ws_i32_ptr + 3 * num_parts + cand, key, mask=in_list)
    tl.store(ws_i32_ptr + 3 * num_parts + num_parts * R + cand, cols.to(tl.int32), mask=in_list)
    tl.store(ws_i32_ptr + num_parts + part, n_list)
    tl.store(ws_i32_ptr + 2 * num_parts + part, key_hi)
    tl.store(ws_f32_ptr + num_parts + part, s_max_c)
    tl.store(ws_f32_ptr + 2 * num_parts + part, tl.sum(e, axis=0))
    tl.store(ws_i64_ptr + part, bound)
    # Noise for the (at most R) listed tokens only; the list goes through memory.
    tl.debug_barrier()
    offs_r = tl.arange(0, R)
    listed = offs_r < n_list
    r_key = tl.load(ws_i32_ptr + 3 * num_parts + part * R + offs_r, mask=listed, other=0)
    r_col = tl.load(ws_i32_ptr + 3 * num_parts + num_parts * R + part * R + offs_r,
                    mask=listed, other=0)
    r_s = (r_key ^ ((r_key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    u_list = _philox_uniform(r_col, position, sample_index, seed)
    tl.store(ws_f32_ptr + 3 * num_parts + part * R + offs_r, r_s - tl.log(-tl.log(u_list)),
             mask=listed)


@triton.jit
def _sample_combine_kernel(
    # pointers
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    sample_indices_ptr,
    positions_ptr,
    ws_f32_ptr,
    ws_i32_ptr,
    ws_i64_ptr,
    out_ptr,
    # sizes
    vocab,
    num_chunks,
    num_parts,
    # strides
    stride_logits_b,
    # meta
    R: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """One row: combine the chunk partials in chunk order, or find the top-k / top-p threshold
    over the candidate lists and draw there; a row whose kept set the lists may not hold falls
    back to exact sweeps over its whole row."""
    row = tl.program_id(0).to(tl.int64)
    temperature, is_greedy, top_k, top_p, do_top_k, do_top_p = _row_params(
        temperature_ptr, top_k_ptr, top_p_ptr, row, vocab)
    offs_c = tl.arange(0, CHUNKS_POW2)
    mask_c = offs_c < num_chunks
    parts = row * num_chunks + offs_c
    if do_top_k | do_top_p:
        s_max = tl.max(tl.load(ws_f32_ptr + num_parts + parts, mask=mask_c,
                               other=float("-inf")), axis=0)
        key_max = tl.max(tl.load(ws_i32_ptr + 2 * num_parts + parts, mask=mask_c,
                                 other=-2147483648), axis=0).to(tl.int64)
        bound_max = tl.max(tl.load(ws_i64_ptr + parts, mask=mask_c, other=KEY_FLOOR), axis=0)
        # Candidate slots [chunk, r], flattened in chunk order (ascending ids inside a chunk).
        offs = tl.arange(0, CHUNKS_POW2 * R)
        slot_chunk = offs // R
        slot_part = row * num_chunks + slot_chunk
        n_list = tl.load(ws_i32_ptr + num_parts + slot_part, mask=slot_chunk < num_chunks, other=0)
        valid = (slot_chunk < num_chunks) & (offs % R < n_list)
        cand = slot_part * R + offs % R
        key = tl.load(ws_i32_ptr + 3 * num_parts + cand, mask=valid, other=0).to(tl.int64)
        # S: every element of the row with key >= bound_max; the lists hold all of them.
        in_s = valid & (key >= bound_max)
        fast = row >= 0  # a true scalar tensor (branches below reassign it)
        t_k = tl.zeros([], tl.int64) + KEY_FLOOR
        if do_top_k:
            n_s = tl.sum(in_s.to(tl.int64), axis=0)
            fast = n_s >= top_k
            # Largest t with count(key >= t) >= k; count(lo) >= k > count(hi).
            lo = tl.min(tl.where(in_s, key, 1 << 40), axis=0)
            hi = tl.where(fast, key_max + 1, lo + 1)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                count = tl.sum((in_s & (key >= mid)).to(tl.int64), axis=0)
                exact = count == top_k
                lo = tl.where(count >= top_k, mid, lo)
                hi = tl.where(exact, mid + 1, tl.where(count >= top_k, hi, mid))
            t_k = lo
        threshold = t_k
        z_all = tl.zeros([], tl.int64)
        if do_top_p & ~do_top_k:
            # The whole row's mass: the listed tokens exactly plus each chunk's rest.
            c_max = tl.load(ws_f32_ptr + num_parts + parts, mask=mask_c, other=float("-inf"))
            c_rest = tl.load(ws_f32_ptr + 2 * num_parts + parts, mask=mask_c, other=0.0)
            scale = tl.exp(_minus_max(c_max, s_max))
            scale = tl.minimum(tl.where(scale == scale, scale, 0.0), 1.0)
            z_rest = tl.sum((c_rest * scale * MASS_ONE).to(tl.int64), axis=0)
            s_cand = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.int32).to(tl.float32, bitcast=True)
            z_all = z_rest + tl.sum(tl.where(valid, _fixed_mass(s_cand, s_max), 0), axis=0)
        if do_top_p & fast:
            s_cand = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.int32).to(tl.float32, bitcast=True)
            mass = tl.where(in_s, _fixed_mass(s_cand, s_max), 0)
            in_k = in_s & (key >= t_k)
            z = tl.where(do_top_k, tl.sum(tl.where(in_k, mass, 0), axis=0), z_all)
            target = (top_p.to(tl.float64) * z.to(tl.float64)).to(tl.int64)
            # Smallest t with mass(key > t) < target over t >= max(t_k, bound_max) - 1.
            lo = tl.maximum(t_k, bound_max) - 1
            fast = tl.sum(tl.where(in_k & (key > lo), mass, 0), axis=0) >= target
            hi = tl.where(fast, key_max, lo + 1)
            n_above_lo = tl.sum((in_k & (key > lo)).to(tl.int64), axis=0)
            n_from_hi = tl.sum((in_k & (key >= hi)).to(tl.int64), axis=0)
            while (hi - lo > 1) & (n_above_lo != n_from_hi):
                mid = lo + (hi - lo) // 2
                above = in_k & (key > mid)
                below = tl.sum(tl.where(above, mass, 0), axis=0) < target
                n_above = tl.sum(above.to(tl.int64), axis=0)
                n_from = tl.sum((in_k & (key >= mid)).to(tl.int64), axis=0)
                hi = tl.where(below, mid, hi)
                n_from_hi = tl.where(below, n_from, n_from_hi)
                lo = tl.where(below, lo, mid)
                n_above_lo = tl.where(below, n_above_lo, n_above)
            threshold = hi
        if fast:
            kept = in_s & (key >= threshold)
            noisy = tl.load(ws_f32_ptr + 3 * num_parts + cand, mask=kept, other=float("-inf"))
            _, at = tl.max(tl.where(kept, noisy, float("-inf")), axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
            at_chunk = tl.minimum(at // R, num_chunks - 1)  # NaN values: stay in this row
            at_valid = at % R < tl.load(ws_i32_ptr + num_parts + row * num_chunks + at_chunk)
            token = tl.load(ws_i32_ptr + 3 * num_parts + num_parts * R
                            + (row * num_chunks + at_chunk) * R + at % R, mask=at_valid, other=0)
            tl.store(out_ptr + row, token.to(tl.int64))
        else:
            _sample_row_exact(
                logits_ptr + row * stride_logits_b, out_ptr + row, vocab, temperature, top_k,
                top_p, do_top_k, do_top_p, s_max, key_max, z_all,
                tl.load(seeds_ptr + row), tl.load(sample_indices_ptr + row),
                tl.load(positions_ptr + row), BLOCK_F)
        # Which path ran (0 candidates, 1 sweeps), for tests: over this row's first bound, which
        # this program alone reads and has read above.
        tl.store(ws_i64_ptr + row * num_chunks, tl.where(fast, 0, 1).to(tl.int64))
    else:
        vals = tl.load(ws_f32_ptr + parts, mask=mask_c, other=float("-inf"))
        _, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        token = tl.load(ws_i32_ptr + row * num_chunks + tl.minimum(at, num_chunks - 1))
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _sample_row_exact(
    row_ptr, out_ptr, vocab, temperature, top_k, top_p, do_top_k, do_top_p, s_max, key_max,
    z_all, seed, sample_index, position, BLOCK_F: tl.constexpr,
):
    """The same thresholds and draw as the candidate path, by sweeps over the whole row (the rows
    whose kept set the candidate lists may not hold: large k, flat distributions)."""
    offs = tl.arange(0, BLOCK_F)
    temp_block = tl.zeros([BLOCK_F], tl.float32) + tl.maximum(temperature, 1e-6)
    t_k = tl.zeros([], tl.int64) + KEY_FLOOR
    if do_top_k:
        lo = tl.zeros([], tl.int64) - 2147483648
        hi = key_max + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            count = tl.zeros([], tl.int64)
            for start in range(0, vocab, BLOCK_F):
                cols = start + offs
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                bits = tl.math.div_rn(x.to(tl.float32), temp_block).to(tl.int32, bitcast=True)
                key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
                count += tl.sum(((cols < vocab) & (key >= mid)).to(tl.int64), axis=0)
            exact = count == top_k
            lo = tl.where(count >= top_k, mid, lo)
            hi = tl.where(exact, mid + 1, tl.where(count >= top_k, hi, mid))
        t_k = lo
    threshold = t_k
    if do_top_p:
        z = z_all
        n_above_lo = tl.zeros([], tl.int64)
        n_from_hi = tl.zeros([], tl.int64)
        for start in range(0, vocab, BLOCK_F):
            cols = start + offs
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
            s = tl.math.div_rn(x.to(tl.float32), temp_block)
            bits = s.to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            in_k = (cols < vocab) & (key >= t_k)
            if do_top_k:
                z += tl.sum(tl.where(in_k, _fixed_mass(s, s_max), 0), axis=0)
            n_above_lo += tl.sum(in_k.to(tl.int64), axis=0)
            n_from_hi += tl.sum((in_k & (key >= key_max)).to(tl.int64), axis=0)
        target = (top_p.to(tl.float64) * z.to(tl.float64)).to(tl.int64)
        lo = tl.maximum(t_k, -2147483648) - 1  # every int32 key is above
        hi = key_max
        while (hi - lo > 1) & (n_above_lo != n_from_hi):
            mid = lo + (hi - lo) // 2
            mass = tl.zeros([], tl.int64)
            n_above = tl.zeros([], tl.int64)
            n_from = tl.zeros([], tl.int64)
            for start in range(0, vocab, BLOCK_F):
                cols = start + offs
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                s = tl.math.div_rn(x.to(tl.float32), temp_block)
                bits = s.to(tl.int32, bitcast=True)
                key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
                in_k = (cols < vocab) & (key >= t_k)
                mass += tl.sum(tl.where(in_k & (key > mid), _fixed_mass(s, s_max), 0), axis=0)
                n_above += tl.sum((in_k & (key > mid)).to(tl.int64), axis=0)
                n_from += tl.sum((in_k & (key >= mid)).to(tl.int64), axis=0)
            below = mass < target
            hi = tl.where(below, mid, hi)
            n_from_hi = tl.where(below, n_from, n_from_hi)
            lo = tl.where(below, lo, mid)
            n_above_lo = tl.where(below, n_above_lo, n_above)
        threshold = hi
    best_val = tl.zeros([], tl.float32) + float("-inf")
    best_idx = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK_F):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
        s = tl.math.div_rn(x.to(tl.float32), temp_block)
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        u = _philox_uniform(cols, position, sample_index, seed)
        val = tl.where(mask & (key >= threshold), s - tl.log(-tl.log(u)), float("-inf"))
        block_val, block_idx = tl.max(
            val, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        better = block_val > best_val  # strict: an earlier block wins a tie
        best_idx = tl.where(better, start + block_idx.to(tl.int64), best_idx)
        best_val = tl.where(better, block_val, best_val)
    tl.store(out_ptr, best_idx)


@triton.jit
def _uniform_kernel(
    # pointers
    seeds_ptr,
    sample_indices_ptr,
    positions_ptr,
    out_ptr,
    # sizes
    vocab,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    u = _philox_uniform(
        cols,
        tl.load(positions_ptr + row),
        tl.load(sample_indices_ptr + row),
        tl.load(seeds_ptr + row),
    )
    tl.store(out_ptr + row * vocab + cols, u, mask=cols < vocab)


# One compiled kernel whatever the number of ids per row: a row's logsumexp runs the same code
# for its sampled token alone as with its top-N.
@triton.jit(do_not_specialize=["num_ids"])
def _token_logprobs_kernel(
    # pointers
    logits_ptr,
    token_ids_ptr,
    out_ptr,
    # sizes
    vocab,
    num_ids,
    # strides
    stride_logits_b,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_b
    offs = tl.arange(0, BLOCK_V)
    # Online logsumexp in fp32, blocks in vocab order (a fixed order for a fixed V).
    m = tl.zeros([], tl.float32) + float("-inf")
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.where(m == new_m, 1.0, tl.exp(m - new_m))  # m = new_m = -inf: keep 0, no NaN
        total = total * alpha + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m)), axis=0)
        m = new_m
    lse = m + tl.log(total)
    # Every id of the row against the same logsumexp: a row's top-N and its sampled token's
    # logprobs are consistent to the bit.
    for k in range(num_ids):
        token = tl.load(token_ids_ptr + row * num_ids + k).to(tl.int64)
        valid = (token >= 0) & (token < vocab)  # an out-of-range id gives NaN, never a wild read
        x_token = tl.load(row_ptr + token, mask=valid, other=float("nan")).to(tl.float32)
        tl.store(out_ptr + row * num_ids + k, x_token - lse)


