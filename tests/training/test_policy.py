"""The trainer forward (``corun.training.Policy``): gradients against transformers' model in fp64,
and its API's checks.

A HF model with random weights is saved and loaded by the policy (torch backend, fp32, CPU);
both compute ``sum_i c_i * logprob_i`` over a few sequences (random coefficients, so every
position's gradient counts) and backpropagate. Each HF parameter's gradient is compared to the
policy's, viewed under the checkpoint's names (``models.loader.checkpoint_views``), by relative
norm: the forwards differ by fp32 rounding only, so the gradients agree to ~1e-6.
"""

from __future__ import annotations

import random

import pytest
import torch

from corun.training import Policy
from models.loader import checkpoint_views
from tests.models.test_deepseek_v3_parity import make_hf_deepseek_v3
from tests.models.test_hy3_parity import make_hf_hy3
from tests.models.test_qwen3_moe_parity import make_hf_qwen3_moe
from tests.models.test_qwen3_parity import make_hf_qwen3

TOLERANCE = 1e-4
FAMILIES = {
    "qwen3": lambda: make_hf_qwen3(tie=False),
    "qwen3-tied": lambda: make_hf_qwen3(tie=True),
    "qwen3-moe": make_hf_qwen3_moe,
    "deepseek-v3": lambda: make_hf_deepseek_v3(q_lora_rank=32),
    "hy3": make_hf_hy3,
}


def _sequences(seed: int = 0) -> tuple[list[list[int]], list[torch.Tensor]]:
    rng = random.Random(seed)
    sequences = [[rng.randrange(256) for _ in range(rng.randrange(6, 40))] for _ in range(3)]
    coefficients = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i))
                    for i, s in enumerate(sequences)]
    return sequences, coefficients


def _hf_gradients(hf_model, sequences, coefficients) -> dict[str, torch.Tensor]:
    model = hf_model.double()
    loss = 0.0
    for seq, coef in zip(sequences, coefficients, strict=True):
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq[1:]).view(-1, 1))
        loss = loss + (logprobs[:, 0] * coef.double()).sum()
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_match_fp64_transformers(tmp_path, family):
    hf_model = FAMILIES[family]()
    hf_model.save_pretrained(tmp_path / "ckpt")
    policy = Policy(str(tmp_path / "ckpt"), mode="corun", dtype="float32", device="cpu",
                    backend="torch", max_model_len=128)
    sequences, coefficients = _sequences()
    logprobs = policy.sequence_logprobs(sequences)
    sum((lp * c).sum() for lp, c in zip(logprobs, coefficients, strict=True)).backward()
    ours = checkpoint_views(policy.model, {n: p.grad for n, p in policy.model.named_parameters()
                                           if p.grad is not None})
    reference = _hf_gradients(hf_model, sequences, coefficients)
    assert reference, "the reference produced no gradient"
    for name, grad in reference.items():
        assert name in ours, f"{family}: no gradient for {name}"
        error = float((ours[name].double() - grad).norm() / grad.norm())
        assert error <= TOLERANCE, f"{family} {name}: relative gradient error {error:.3g}"


def test_gradients_through_the_triton_kernels(tmp_path):
    """The Triton backend's forward (the interpreter here) with the torch references'
    backward: the same gradients as transformers' fp64 model."""
    hf_model = make_hf_qwen3(tie=False)
    hf_model.save_pretrained(tmp_path / "ckpt")
    policy = Policy(str(tmp_path / "ckpt"), mode="batch_invariant", dtype="float32",
                    device="cpu", backend="triton", max_model_len=128)
    sequences, coefficients = _sequences(1)
    logprobs = policy.sequence_logprobs(sequences)
    sum((lp * c).sum() for lp, c in zip(logprobs, coefficients, strict=True)).backward()
    ours = checkpoint_views(policy.model, {n: p.grad for n, p in policy.model.named_parameters()})
    for name, grad in _hf_gradients(hf_model, sequences, coefficients).items():
        error = float((ours[name].double() - grad).norm() / grad.norm())
        assert error <= TOLERANCE, f"{name}: relative gradient error {error:.3g}"


def test_an_optimizer_step_moves_the_parameters():
    policy = Policy("tiny-qwen3", mode="corun", backend="torch", device="cpu")
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    (-policy.sequence_logprobs([[3, 9, 27, 81, 243]])[0].sum()).backward()
    optimizer.step()
    moved = [n for n, p in policy.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), f"not stepped: {set(before) - set(moved)}"


def test_logprobs_without_autograd_are_the_same_bits():
    policy = Policy("tiny-qwen3-moe", mode="corun", backend="torch", device="cpu")
    prompts, completions = [[1, 2, 3], [7, 8]], [[4, 5], [9, 10, 11]]
    with_grad = policy.completion_logprobs(prompts, completions)
    with torch.no_grad():
        without = policy.completion_logprobs(prompts, completions)
    for a, b in zip(with_grad, without, strict=True):
        assert a.requires_grad and torch.equal(a.detach(), b)


@pytest.mark.parametrize("call, match", [
    (lambda p: p.sequence_logprobs([]), "sequences"),
    (lambda p: p.sequence_logprobs([[1, 2], []]), "sequences"),
    (lambda p: p.completion_logprobs([[1]], []), "completions"),
    (lambda p: p.completion_logprobs([[1]], [[]]), "completions"),
])
def test_bad_input_is_refused(call, match):
    policy = Policy("tiny-qwen3", mode="corun", backend="torch", device="cpu")
    with pytest.raises(ValueError, match=match):
        call(policy)


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Policy("tiny-qwen3", mode="corun", backend="torch", device="cpu",
               tensor_parallel_size=2)
