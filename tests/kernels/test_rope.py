"""RoPE kernel vs the fp64 reference (both layouts, in/out of place, strided views) and the
cos/sin cache vs transformers' rope init functions (plain and DeepSeek-V3 YaRN)."""

import math

import pytest
import torch

from kernels.reference import rope_reference
from kernels.rope import (
    RopeConfig,
    build_rope_cache,
    rope,
    rope_config,
    rope_inv_freq,
    yarn_attention_scale,
)
from tests.utils import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEEPSEEK_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _qk(tokens, q_heads, k_heads, rotary_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, q_heads, rotary_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, rotary_dim, generator=gen).to(dtype)
    return q, k, gen


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "shape",
    [(1, 4, 2, 16), (5, 3, 1, 34), (3, 8, 8, 64)],
    ids=["1t-4q-2k-16", "5t-3q-1k-34", "3t-8q-8k-64"],
)
def test_rope_matches_reference(shape, is_neox, dtype):
    tokens, q_heads, k_heads, rotary_dim = shape
    q, k, gen = _qk(tokens, q_heads, k_heads, rotary_dim, dtype, seed=sum(shape))
    cache = build_rope_cache(rotary_dim, 257, 10000.0)
    positions = torch.randint(0, 257, (tokens,), generator=gen)
    q_out, k_out = rope(q, k, positions, cache, is_neox)
    q_ref, k_ref = rope_reference(q.double(), k.double(), positions, cache.double(), is_neox)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    # In place writes the very same bits into q and k.
    q_in, k_in = q.clone(), k.clone()
    rope(q_in, k_in, positions.int(), cache, is_neox, inplace=True)
    assert torch.equal(q_in, q_out) and torch.equal(k_in, k_out)


def test_rope_strided_views_deepseek_layout():
    """DeepSeek-V3: the rope part of q [T, H, nope + R] and a single shared k head, interleaved."""
    gen = torch.Generator().manual_seed(5)
    q_full = torch.randn(4, 3, 8 + 16, generator=gen)
    ckv = torch.randn(4, 12 + 16, generator=gen)
    q_pe, k_pe = q_full[..., 8:], ckv[:, 12:].unsqueeze(1)
    cache = build_rope_cache(
        16,
        64,
        10000.0,
        {"rope_type": "yarn", **DEEPSEEK_YARN, "factor": 4, "original_max_position_embeddings": 16},
    )
    positions = torch.tensor([0, 63, 17, 17])
    q_ref, k_ref = rope_reference(q_pe.double(), k_pe.double(), positions, cache.double(), False)
    q_out, k_out = rope(q_pe, k_pe, positions, cache, False)
    assert_close(q_out, q_ref, torch.float32)
    assert_close(k_out, k_ref, torch.float32)
    rope(q_pe, k_pe, positions, cache, False, inplace=True)
    assert torch.equal(q_full[..., 8:], q_out) and torch.equal(ckv[:, 12:], k_out[:, 0])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "block_h, block_t", [(2, 3), (16, 1), (4, 4)], ids=["2h-3t", "16h-1t", "4h-4t"]
)
def test_rope_any_config_same_bits(is_neox, block_h, block_t):
    """Head tiles (a partial last one) and token blocks (a partial last one) change nothing:
    the op is elementwise, which is what lets the policy read the token count."""
    q_full, k, gen = _qk(7, 11, 3, 32 + 16, torch.bfloat16, seed=block_h * 10 + block_t)
    q = q_full[..., 16:]  # strided rope view, DeepSeek-style
    k = k[..., :32]
    cache = build_rope_cache(32, 64, 10000.0)
    positions = torch.randint(0, 64, (7,), generator=gen)
    default = rope(q, k, positions, cache, is_neox)
    cfg = RopeConfig(BLOCK_D=16, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=1)
    tiled = rope(q, k, positions, cache, is_neox, config=cfg)
    assert torch.equal(default[0], tiled[0]) and torch.equal(default[1], tiled[1])
    q_ref, k_ref = rope_reference(q.double(), k.double(), positions, cache.double(), is_neox)
    assert_close(tiled[0], q_ref, torch.bfloat16)
    assert_close(tiled[1], k_ref, torch.bfloat16)


def test_rope_config_deepseek_tiles():
    """DeepSeek-V3's rope (128 q heads, 1 k head, R = 64): 64-head tiles, 4 tokens a program
    past ~700 tokens; Qwen3-8B (32 + 8 heads, R = 128): all q heads in one tile."""
    assert rope_config(8192, 128, 1, 64, torch.bfloat16) == RopeConfig(32, 64, 4, 8)
    assert rope_config(256, 128, 1, 64, torch.bfloat16).BLOCK_T == 1
    assert rope_config(8192, 32, 8, 128, torch.bfloat16).BLOCK_H == 32


def _hf_inv_freq(scaling: dict | None, rotary_dim: int, theta: float, max_pos: int):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=rotary_dim,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        return DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        DEEPSEEK_YARN,
        {**DEEPSEEK_YARN, "mscale": 0.707},
        {**DEEPSEEK_YARN, "beta_fast": 8, "factor": 4},
    ],
    ids=["default", "deepseek-v3-yarn", "yarn-mscale-0.707", "yarn-beta-fast-8"],
)
def test_rope_inv_freq_equals_transformers(scaling):
    hf_inv_freq, hf_attention_factor = _hf_inv_freq(scaling, 64, 10000.0, 163840)
    inv_freq, attention_factor = rope_inv_freq(64, 10000.0, scaling)
    assert torch.equal(inv_freq, hf_inv_freq.float())
    assert attention_factor == pytest.approx(hf_attention_factor, rel=1e-12)
    # The cache is cos | sin of position * inv_freq, the attention factor folded in (HF's forward).
    cache = build_rope_cache(64, 33, 10000.0, scaling)
    angles = torch.arange(33, dtype=torch.float32)[:, None] * hf_inv_freq.float()[None, :]
    assert torch.equal(cache[:, :32], angles.cos() * hf_attention_factor)
    assert torch.equal(cache[:, 32:], angles.sin() * hf_attention_factor)


def test_yarn_attention_scale_deepseek_v3():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = transformers.DeepseekV3Config(rope_scaling=DEEPSEEK_YARN, rope_theta=10000.0)
    assert yarn_attention_scale(DEEPSEEK_YARN) == pytest.approx(
        yarn_apply_mscale(config.rope_parameters, 1.0), rel=1e-12
    )
    assert yarn_attention_scale(DEEPSEEK_YARN) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert yarn_attention_scale(None) == 1.0
    assert yarn_attention_scale({"rope_type": "default", "rope_theta": 1e6}) == 1.0


def test_scaling_dict_styles_agree():
    """Legacy "type", "rope_type" and v5 rope_parameters (rope_theta inside) give one cache."""
    legacy = build_rope_cache(32, 16, 10000.0, DEEPSEEK_YARN)
    modern = {k: v for k, v in DEEPSEEK_YARN.items() if k != "type"}
    assert torch.equal(legacy, build_rope_cache(32, 16, 10000.0, {"rope_type": "yarn", **modern}))
    v5 = {"rope_type": "yarn", "rope_theta": 10000.0, **modern}
    assert torch.equal(legacy, build_rope_cache(32, 16, 1.0, v5))
    plain_v5 = {"rope_type": "default", "rope_theta": 1e6}
    assert torch.equal(build_rope_cache(32, 16, 1e6), build_rope_cache(32, 16, 5.0, plain_v5))


@pytest.mark.parametrize(
    "case, name",
    [
        (lambda q, k, p, c: rope(q, k[:, :, :-2], p, c, True), "k"),
        (lambda q, k, p, c: rope(q, k.half(), p, c, True), "k"),
        (lambda q, k, p, c: rope(q, k, p.float(), c, True), "positions"),
        (lambda q, k, p, c: rope(q, k, p[:-1], c, True), "positions"),
        (lambda q, k, p, c: rope(q, k, p, c[:, :-2], True), "cos_sin_cache"),
        (lambda q, k, p, c: rope(q[0], k, p, c, True), "q"),
        (lambda q, k, p, c: rope(q, k, p, c, 1), "is_neox"),
        (lambda q, k, p, c: build_rope_cache(15, 8, 1e4), "rotary_dim"),
        (lambda q, k, p, c: build_rope_cache(16, 8, 1e4, {"type": "yarn", "factor": 4}), "scaling"),
        (lambda q, k, p, c: build_rope_cache(16, 8, 1e4, {"rope_type": "longrope"}), "scaling"),
    ],
    ids=[
        "k-shape",
        "k-dtype",
        "positions-dtype",
        "positions-shape",
        "cache-width",
        "q-ndim",
        "is-neox-type",
        "odd-rotary-dim",
        "yarn-missing-key",
        "unsupported-type",
    ],
)
def test_rope_bad_input_names_argument(case, name):
    q, k, _ = _qk(3, 2, 1, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=f"^{name}"):
        case(q, k, torch.arange(3), build_rope_cache(16, 8, 1e4))
