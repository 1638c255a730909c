"""Tensor parallelism of the tiny models on CPU with gloo (torch backend, fp32).

- Random-weight builds: every rank's parameters are its pieces of the TP=1 weights, bit for bit
  (kv heads split at TP=2 and replicated at TP=4).
- Loader: from transformers ``save_pretrained`` checkpoints, each rank holds only its shard
  (local shapes, bytes summing to the full model's) and its pieces equal the TP=1 load.
- Two processes: TP=2 logits of a prefill and 2 decode steps match TP=1 within fp32 tolerance
  under corun (plain all-reduce) and batch_invariant (rank-order reduction), dense, MoE (softmax
  and sigmoid routers, shared experts) and MLA;
  both ranks return the same full-vocabulary logits.
- A worker that raises or dies makes ``spawn_workers`` raise within seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from kernels.mode import Mode
from models import build_model
from models.forward_batch import OpsConfig
from models.loader import load_model
from models.parallel import ParallelContext, WorkerError, spawn_workers
from models.weights import parameter_layouts
from tests.models.helpers import relative_error, run_sequence

MODELS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-hy3")
MODES = (Mode.CORUN, Mode.BATCH_INVARIANT)
# Measured max |TP2 - TP1| / max |TP1| over steps: 4.4e-7 to 8.9e-7 (MLA batch_invariant highest).
TOLERANCE = 1e-5


def assert_pieces_of(sharded: torch.nn.Module, full: torch.nn.Module) -> None:
    """Every parameter of ``sharded`` is its ShardLayout's pieces of ``full``, bitwise; padding
    is zero."""
    full_params = dict(full.named_parameters())
    for name, layout in parameter_layouts(sharded).items():
        local = dict(sharded.named_parameters())[name]
        assert tuple(full_params[name].shape) == layout.full_shape, name
        covered = torch.zeros_like(local, dtype=torch.bool)
        for local_index, full_index in layout.pieces:
            assert torch.equal(local[local_index], full_params[name][full_index]), name
            covered[local_index] = True
        assert torch.equal(local[~covered], torch.zeros_like(local[~covered])), name


def make_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (11,), generator=gen), torch.randint(0, 256, (2,), generator=gen)


@pytest.mark.parametrize("name", MODELS)
def test_random_weight_shards_are_slices_of_tp1(name):
    full, _ = build_model(name, dtype=torch.float32, device="cpu", seed=3)
    world_sizes = (2, 4) if name == "tiny-qwen3" else (2,)  # 2 kv heads: split, then replicated
    for world in world_sizes:
        for rank in range(world):
            parallel = ParallelContext(rank, world)
            model, config = build_model(name, dtype=torch.float32, device="cpu", seed=3,
                                        parallel=parallel)
            assert_pieces_of(model, full)
            if name != "tiny-deepseek-v3":
                expected_kv = max(config.num_key_value_heads // world, 1)
                assert model.kv_cache_spec().num_kv_heads == expected_kv
                attn = model.model.layers[0].self_attn
                assert attn.num_heads == config.num_attention_heads // world
            else:
                assert model.kv_cache_spec() == full.kv_cache_spec()  # latent cache replicated


def test_uneven_heads_raise_naming_the_field():
    with pytest.raises(ValueError, match="num_attention_heads"):
        build_model("tiny-qwen3", dtype=torch.float32, device="cpu",
                    parallel=ParallelContext(0, 3))


def _checkpoints(tmp_path):
    from tests.models.test_deepseek_v3_parity import make_hf_deepseek_v3
    from tests.models.test_hy3_parity import make_hf_hy3
    from tests.models.test_qwen3_moe_parity import make_hf_qwen3_moe
    from tests.models.test_qwen3_parity import make_hf_qwen3

    yield "qwen3", make_hf_qwen3(tie=False), {}
    yield "qwen3-tied", make_hf_qwen3(tie=True), {}
    moe = make_hf_qwen3_moe()
    yield "qwen3-moe-per-expert", moe, {"save_original_format": True}
    yield "qwen3-moe-fused", moe, {"save_original_format": False}
    yield "deepseek-v3", make_hf_deepseek_v3(32), {}
    hy3 = make_hf_hy3()
    yield "hy3-moe-hub", hy3, {"save_original_format": True}
    yield "hy3-moe-fused", hy3, {"save_original_format": False}


def test_loader_loads_only_the_rank_shard(tmp_path):
    for label, hf_model, save_kwargs in _checkpoints(tmp_path):
        path = tmp_path / label
        hf_model.save_pretrained(path, **save_kwargs)
        full, _ = load_model(path, dtype=torch.float32, device="cpu")
        full_bytes = {n: p.numel() * p.element_size() for n, p in full.named_parameters()}
        rank_bytes = {n: 0 for n in full_bytes}
        for rank in range(2):
            model, _ = load_model(path, dtype=torch.float32, device="cpu",
                                  parallel=ParallelContext(rank, 2))
            assert_pieces_of(model, full)
            for n, p in model.named_parameters():
                rank_bytes[n] += p.numel() * p.element_size()
        layouts = parameter_layouts(model)
        for n, layout in layouts.items():
            is_sharded = len(layout.pieces[0][1]) > 0
            # A sharded parameter's two halves add up to the full tensor; replicated: twice.
            assert rank_bytes[n] == full_bytes[n] * (1 if is_sharded else 2), (label, n)
        sharded = [n for n, layout in layouts.items() if len(layout.pieces[0][1]) > 0]
        assert any("experts" in n for n in sharded) or "moe" not in label, label
        assert sum(rank_bytes.values()) < 2 * sum(full_bytes.values()), label


def _tp_forward(parallel: ParallelContext, seed: int) -> dict:
    """Worker: each tiny model at this rank's shard, prefill + 2 decode steps, per mode."""
    prompt, decode_ids = make_inputs(seed)
    out = {}
    for name in MODELS:
        model, _ = build_model(name, dtype=torch.float32, device="cpu", seed=seed,
                               parallel=parallel)
        for mode in MODES:
            ops = OpsConfig(mode=mode, backend="torch")
            with torch.no_grad():
                out[name, mode.value] = run_sequence(model, prompt, decode_ids, ops)
    return out


@pytest.fixture(scope="module")
def tp2_logits():
    return spawn_workers(_tp_forward, 2, (5,), start_method="fork", num_threads=1,
                         timeout_s=120)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("name", MODELS)
def test_tp2_logits_match_tp1(tp2_logits, name, mode):
    prompt, decode_ids = make_inputs(5)
    model, _ = build_model(name, dtype=torch.float32, device="cpu", seed=5)
    with torch.no_grad():
        ref = run_sequence(model, prompt, decode_ids, OpsConfig(mode=mode, backend="torch"))
    rank0, rank1 = (result[name, mode.value] for result in tp2_logits)
    assert len(rank0) == 3  # prefill + 2 decode steps
    for a, b in zip(rank0, rank1, strict=True):
        assert torch.equal(a, b)  # every rank gathers the same full-vocabulary logits
        assert a.shape[-1] == 256
    err = relative_error(rank0, ref)
    print(f"{name} {mode.value}: max|TP2 - TP1| / max|TP1| = {err:.3g}")
    assert err <= TOLERANCE, f"max|TP2 - TP1| / max|TP1| = {err:.3g} > {TOLERANCE}"


def _fail_on_rank1(parallel: ParallelContext) -> None:
    if parallel.rank == 1:
        raise RuntimeError("boom on rank 1")
    parallel.all_reduce(torch.ones(4), Mode.CORUN)  # rank 0 blocks on the dead peer


def _exit_on_rank0(parallel: ParallelContext) -> None:
    if parallel.rank == 0:
        os._exit(3)
    parallel.all_reduce(torch.ones(4), Mode.CORUN)


@pytest.mark.parametrize(("fn", "match"), [
    (_fail_on_rank1, r"rank 1 failed:(.|\n)*RuntimeError: boom on rank 1"),
    (_exit_on_rank0, r"rank 0 exited with code 3"),
], ids=["raises", "dies"])
def test_failed_worker_raises_within_seconds(fn, match):
    """The parent names the failed rank as soon as it fails (its report or its exit code), not
    at the run's timeout: a run that waited for the timeout raises "timed out", which ``match``
    refuses (an event, where a wall-clock bound would only add flakiness on a loaded CPU)."""
    with pytest.raises(WorkerError, match=match) as info:
        spawn_workers(fn, 2, start_method="fork", num_threads=1, timeout_s=60)
    assert "timed out" not in str(info.value)
    assert not [p for p in mp.active_children() if p.name.startswith("corun-tp-rank")]
