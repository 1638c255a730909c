"""probe_mla_prefill's kernel on the interpreter: the loop it times computes the causal sum of
(q . k^T rounded) . v over both qk parts, the unmasked and the diagonal tiles together (a tile
dropped, repeated or left unmasked changes the sums), and bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from experiments.probe_mla_prefill import prefill_dots, prefill_dots_reference

TILES = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("length", [32, 96])
def test_the_probe_loop_computes_the_causal_products(length):
    torch.manual_seed(length)
    q, k = (torch.randn(length, 2, 48) for _ in range(2))  # qk 48 = 32 + 16, as 192 = 128 + 64
    v = torch.randn(length, 2, 16)
    out = prefill_dots(q, k, v, **TILES)
    torch.testing.assert_close(out, prefill_dots_reference(q, k, v), rtol=1e-4, atol=1e-3)


def test_the_probe_refuses_shapes_its_tiles_do_not_divide():
    q = torch.randn(40, 2, 48)
    with pytest.raises(ValueError, match="S % 32"):
        prefill_dots(q, q, torch.randn(40, 2, 16), **TILES)
