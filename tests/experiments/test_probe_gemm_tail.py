"""The tail probe's configs: each tile with its tail, TMA-fed, split only while the programs stay
within two an SM and each split keeps two K blocks."""

from __future__ import annotations

from experiments.gemm_candidates import DTYPE
from experiments.probe_gemm_tail import POINTS, tail_configs
from kernels.gemm import SMEM_BUDGET_BYTES, TARGET_NUM_CTAS
from kernels.utils import cdiv


def test_tail_configs_fit_and_split_within_two_programs_an_sm():
    for _, n, k, m_values in POINTS:
        for m in m_values:
            configs = tail_configs(m, n, k)
            assert configs
            for name, cfg in configs.items():
                assert cfg.tma and cfg.block_n_tail == cfg.block_n // 2, name
                assert cfg.smem_bytes(DTYPE.itemsize) <= SMEM_BUDGET_BYTES, name
                programs = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n) * cfg.split_k
                assert cfg.split_k == 1 or programs <= TARGET_NUM_CTAS, name
                assert cdiv(k, cfg.block_k) >= 2 * cfg.split_k, name
    # kv_a at M 8192: 192 programs of 128 x 192 already, so no split is timed; q_a at M 256:
    # 16 tiles of 128 x 192 take splits 2, 4 and 8 (128 programs).
    assert not any(c.split_k > 1 for c in tail_configs(8192, 576, 7168).values()
                   if c.block_m == 128 and c.block_n == 128)
    assert {c.split_k for c in tail_configs(256, 1536, 7168).values()
            if c.block_m == 128 and c.block_n == 128} == {1, 2, 4, 8}
