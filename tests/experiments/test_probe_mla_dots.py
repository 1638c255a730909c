"""probe_mla_dots's kernel on the interpreter: the loop it times computes (q . kv^T) . V, the
step-late P.V included (a wrong carry would drop or repeat a tile), and bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from experiments.probe_mla_dots import mla_dots, mla_dots_reference


@pytest.mark.parametrize("ctx", [16, 48])
def test_the_probe_loop_computes_the_two_products(ctx):
    torch.manual_seed(ctx)
    latent, rope, heads = 32, 16, 32
    q = torch.randn(2, heads, latent + rope)
    kv = torch.randn(2, ctx, latent + rope)
    out = mla_dots(q, kv, latent, block_h=16, block_n=16, num_warps=4, num_stages=1)
    torch.testing.assert_close(out, mla_dots_reference(q, kv, latent), rtol=1e-4, atol=1e-3)


def test_the_probe_refuses_shapes_its_tiles_do_not_divide():
    q, kv = torch.randn(1, 24, 48), torch.randn(1, 32, 48)
    with pytest.raises(ValueError, match="heads % 16"):
        mla_dots(q, kv, 32, block_h=16, block_n=16)
