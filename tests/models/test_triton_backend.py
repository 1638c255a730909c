"""Each tiny model with backend "triton" (the kernels/ launchers, interpreted on the CPU) matches
the torch backend in fp32 for a prompt and two decode steps."""

from __future__ import annotations

import pytest
import torch

from kernels.mode import Mode
from models import build_model
from models.forward_batch import OpsConfig
from tests.models.helpers import relative_error, run_sequence

TOLERANCE = 1e-4


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-hy3"])
def test_triton_backend_matches_torch_backend(name):
    model, config = build_model(name, dtype=torch.float32, device="cpu", seed=5)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, config.vocab_size, (6,), generator=gen)
    decode_ids = torch.randint(0, config.vocab_size, (2,), generator=gen)
    torch_out = run_sequence(model, prompt, decode_ids, OpsConfig(Mode.CORUN, backend="torch"),
                             max_seq_len=32)
    triton_out = run_sequence(model, prompt, decode_ids, OpsConfig(Mode.CORUN, backend="triton",
                                                                   decode_split_size=16),
                              max_seq_len=32)
    err = relative_error(triton_out, torch_out)
    assert err <= TOLERANCE, f"{name}: max|diff|/max|ref| = {err:.3g} > {TOLERANCE}"
