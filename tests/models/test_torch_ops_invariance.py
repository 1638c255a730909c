"""Invariances of the torch backend of ``models.ops`` that the CPU engine relies on."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.mode import Mode
from models import ops
from models.forward_batch import OpsConfig
from tests.utils import assert_bitwise_equal

FULL_M, K, N = 40, 64, 96
BATCH_INVARIANT = OpsConfig(mode=Mode.BATCH_INVARIANT, backend="torch")
CORUN = OpsConfig(mode=Mode.CORUN, backend="torch")
DEFAULT = OpsConfig(mode=Mode.DEFAULT, backend="torch")
# tests/ does not load the invariance_tests profiles: few examples, no deadline (shared CPU).
FEW = settings(max_examples=15, deadline=None, derandomize=True)


def _tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(FULL_M, K, generator=gen), torch.randn(N, K, generator=gen)


@FEW
@given(m=st.integers(1, FULL_M), data=st.data(), seed=st.integers(0, 2**63 - 1))
@example(m=1, data=None, seed=0)
def test_linear_batch_invariant(m, data, seed):
    """Under batch_invariant, row i of linear(x[:m]) equals row i of linear(x) for every m."""
    row = 0 if data is None else data.draw(st.integers(0, m - 1))
    x, w = _tensors(seed)
    assert_bitwise_equal(ops.linear(x[:m], w, BATCH_INVARIANT)[row],
                         ops.linear(x, w, BATCH_INVARIANT)[row], f"m={m} row={row}")


def test_linear_default_is_batch_variant_negative_control():
    """The check above can fail: a plain matmul's row 0 differs between M=1 and M=40 here."""
    x, w = _tensors(0)
    assert not torch.equal(ops.linear(x[:1], w, DEFAULT)[0], ops.linear(x, w, DEFAULT)[0])


@FEW
@given(num_tokens=st.integers(2, 24), data=st.data(), seed=st.integers(0, 2**63 - 1))
def test_fused_moe_token_independent_of_co_tokens(num_tokens, data, seed):
    """Under corun, a token's MoE output is the same alone as among other tokens in any slot."""
    gen = torch.Generator().manual_seed(seed)
    experts, hidden, inter, top_k = 4, 32, 16, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    weights, ids = ops.softmax_topk(torch.randn(num_tokens, experts, generator=gen), top_k,
                                    True, CORUN)
    perm = torch.tensor(data.draw(st.permutations(range(num_tokens))))
    token = data.draw(st.integers(0, num_tokens - 1))
    together = ops.fused_moe(x[perm], w13, w2, weights[perm], ids[perm], CORUN)
    slot = int((perm == token).nonzero())
    alone = ops.fused_moe(x[token : token + 1], w13, w2, weights[token : token + 1],
                          ids[token : token + 1], CORUN)
    assert_bitwise_equal(together[slot], alone[0], f"token {token} at slot {slot}")


def test_fused_moe_default_depends_on_co_tokens_negative_control():
    """The check above can fail: under default the expert GEMM's M is the expert's token count."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen)
    w13, w2 = torch.randn(1, 64, 64, generator=gen), torch.randn(1, 64, 32, generator=gen)
    weights, ids = torch.ones(16, 1), torch.zeros(16, 1, dtype=torch.int32)
    together = ops.fused_moe(x, w13, w2, weights, ids, DEFAULT)
    alone = ops.fused_moe(x[:1], w13, w2, weights[:1], ids[:1], DEFAULT)
    assert not torch.equal(together[0], alone[0])
