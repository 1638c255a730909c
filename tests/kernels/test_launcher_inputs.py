"""Launcher input checks the kernels rely on: index and per-row tensors are read as ``ptr + i``,
so a strided view (``x[::2]``) is refused with a ValueError naming it (it was accepted and the
kernels read other elements: wrong cache slots, attention, RoPE, bias and draws); the MLA
launchers check block ids and slots on host tensors as the attention ones do."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import PrefillAttentionConfig, decode_attention, prefill_attention
from kernels.gemm import gemm
from kernels.kv_store import store_kv, store_mla_kv
from kernels.mla import mla_decode
from kernels.rope import build_rope_cache, rope
from kernels.sampling import sample, sampling_uniform
from tests.kernels.test_attention import make_paged


def _every_other(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A strided view holding ``values`` (the elements between them differ)."""
    spread = torch.tensor([v for value in values for v in (value, value)], dtype=dtype)
    return spread[::2]


def _store_kv(view):
    kc, vc, _, gen = make_paged([40], 2, 16, 8, torch.float32, seed=1)
    store_kv(torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen), kc, vc,
             view([3, 17, 9], torch.int64))


def _decode(view):
    kc, vc, tables, gen = make_paged([5, 20, 12], 2, 16, 8, torch.float32, seed=2)
    decode_attention(torch.randn(3, 4, 16, generator=gen), kc, vc, tables,
                     view([5, 20, 12], torch.int32), 0.25, max_seq_len=32, split_size=16)


def _prefill(view):
    kc, vc, tables, gen = make_paged([6, 9], 2, 16, 8, torch.float32, seed=3)
    prefill_attention(torch.randn(15, 2, 16, generator=gen), kc, vc, tables,
                      torch.tensor([0, 6, 15], dtype=torch.int32), view([6, 9], torch.int32),
                      0.25, max_q_len=9, config=PrefillAttentionConfig(16, 16, 4, 1))


def _rope(view):
    rope(torch.randn(3, 2, 16), torch.randn(3, 1, 16), view([1, 7, 30], torch.int64),
         build_rope_cache(16, 64, 10000.0), True)


def _gemm_bias(view):
    gemm(torch.randn(3, 32), torch.randn(2, 32), view([0.5, -1.0], torch.float32))


def _sample(view):
    ones = torch.ones(3)
    sample(torch.randn(3, 64), view([0.0, 1.0, 1.0], torch.float32), torch.zeros(3,
           dtype=torch.int64), ones, torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64),
           torch.tensor([4, 5, 6]))


def _uniform(view):
    sampling_uniform(view([1, 2], torch.int64), torch.zeros(2, dtype=torch.int64),
                     torch.zeros(2, dtype=torch.int64), 16)


CASES = {"store_kv": (_store_kv, "slot_mapping"), "decode_attention": (_decode, "seq_lens"),
         "prefill_attention": (_prefill, "context_lens"), "rope": (_rope, "positions"),
         "gemm": (_gemm_bias, "bias"), "sample": (_sample, "temperature"),
         "sampling_uniform": (_uniform, "seeds")}


@pytest.mark.parametrize("case", list(CASES))
def test_strided_index_tensors_are_refused(case):
    call, field = CASES[case]
    call(lambda values, dtype: torch.tensor(values, dtype=dtype))  # contiguous: accepted
    with pytest.raises(ValueError, match=f"^{field}: expected a contiguous tensor"):
        call(_every_other)


@pytest.mark.interpreter_only(
    reason="value checks read host tensors only; on a GPU they would sync the device")
def test_mla_launchers_check_block_ids_and_slots():
    cache = torch.randn(4, 8, 32)
    q_latent, q_pe = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    seq_lens = torch.tensor([12], dtype=torch.int32)  # two blocks
    mla_decode(q_latent, q_pe, cache, torch.tensor([[1, 3]], dtype=torch.int32), seq_lens, 0.3,
               max_seq_len=16, split_size=16)
    with pytest.raises(ValueError, match="^block_tables: row 0 points outside the cache"):
        mla_decode(q_latent, q_pe, cache, torch.tensor([[1, 4]], dtype=torch.int32), seq_lens,
                   0.3, max_seq_len=16, split_size=16)
    store_mla_kv(torch.randn(2, 16), torch.randn(2, 16), cache, torch.tensor([-1, 31]))
    for slots in ([-7], [32]):
        with pytest.raises(ValueError, match="^slot_mapping: slots must lie in"):
            store_mla_kv(torch.randn(1, 16), torch.randn(1, 16), cache, torch.tensor(slots))


@pytest.mark.interpreter_only(
    reason="value checks read host tensors only; on a GPU they would sync the device")
@pytest.mark.parametrize("slots", [[-2, 0], [0, 64]])
def test_both_cache_writes_name_the_slots_outside_the_cache(slots):
    """store_kv and store_mla_kv share one slot check: the range allowed and the range given."""
    low, high = min(slots), max(slots)
    message = rf"^slot_mapping: slots must lie in \[-1, 64\) \(-1: skip\), got \[{low}, {high}\]$"
    kc, vc = torch.zeros(8, 8, 2, 16), torch.zeros(8, 8, 2, 16)  # 64 slots
    with pytest.raises(ValueError, match=message):
        store_kv(torch.randn(2, 2, 16), torch.randn(2, 2, 16), kc, vc, torch.tensor(slots))
    with pytest.raises(ValueError, match=message):
        store_mla_kv(torch.randn(2, 16), torch.randn(2, 16), torch.zeros(8, 8, 32),
                     torch.tensor(slots))
    assert not kc.any() and not vc.any()  # refused before any write


@pytest.mark.parametrize("scale", [0.0, -0.25, float("nan"), float("inf"), True, "0.25"])
def test_attention_launchers_refuse_a_scale_that_is_not_a_positive_number(scale):
    """The softmax kernels take the row max of the raw scores and scale it once: the max of the
    scaled scores only for a scale > 0. Each launcher refuses another before any work."""
    from kernels.mla import mla_prefill_attention

    kc, vc, tables, gen = make_paged([6, 9], 2, 16, 8, torch.float32, seed=3)
    lens = torch.tensor([6, 9], dtype=torch.int32)
    cu = torch.tensor([0, 6, 15], dtype=torch.int32)
    x = torch.randn(15, 2, 24, generator=gen)
    calls = [
        lambda: prefill_attention(torch.randn(15, 2, 16, generator=gen), kc, vc, tables, cu,
                                  lens, scale, max_q_len=9),
        lambda: decode_attention(torch.randn(2, 4, 16, generator=gen), kc, vc, tables, lens,
                                 scale, max_seq_len=16),
        lambda: mla_prefill_attention(x, x, x[..., :16].contiguous(), cu, cu, scale, max_q_len=9),
        lambda: mla_decode(torch.randn(2, 4, 16, generator=gen), torch.randn(2, 4, 8,
                           generator=gen), torch.randn(4, 8, 24, generator=gen),
                           torch.arange(4, dtype=torch.int32).view(2, 2), lens, scale,
                           max_seq_len=16),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="scale: expected a finite number > 0"):
            call()
