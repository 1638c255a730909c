"""New weights without a restart (``LLM.update_weights``): after an update a request has exactly
the bits, and the engine exactly the system fingerprint, of a fresh engine built on the same
weights, in every deterministic mode, from named tensors and from a checkpoint directory; a bad
update changes nothing; a started request refuses it; the prefix cache never serves K/V of the
old weights (with its negative control); tensor parallelism (2 gloo ranks) updates every shard.

CPU engine (torch backend, fp32); one Triton (interpreter) case.
"""

from __future__ import annotations

import pytest
import torch

from corun import LLM, SamplingParams
from corun.training import Policy
from models import build_model
from models.loader import CheckpointError, checkpoint_views
from tests.models.helpers import save_named_checkpoint

BASE = dict(dtype="float32", device="cpu", backend="torch", max_num_seqs=4, max_model_len=96,
            block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
            prefill_step_tokens=16, max_prefill_seqs_per_step=4, prefill_token_budget=16,
            skip_tokenizer_init=True)
PROMPTS = [[5, 6, 7, 8, 9] * 5, [9, 8, 7], [3] * 17]
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=2)
MODES = ["corun", "batch_invariant", "batch_invariant_tuned"]


def _run(llm: LLM) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].fingerprint) for o in outs]


def _weights(model: str, seed: int) -> dict[str, torch.Tensor]:
    return checkpoint_views(build_model(model, dtype=torch.float32, device="cpu", seed=seed)[0])


@pytest.mark.parametrize("model, mode", [
    *((model, "corun") for model in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3",
                                     "tiny-hy3")),
    *(("tiny-qwen3", mode) for mode in MODES[1:])])
def test_named_tensor_update_equals_a_fresh_engine(model, mode):
    with LLM(model, mode=mode, seed=0, **BASE) as llm, \
            LLM(model, mode=mode, seed=1, **BASE) as fresh:
        before = _run(llm)
        fingerprint = llm.update_weights(_weights(model, seed=1))
        assert fingerprint == llm.system_fingerprint == fresh.system_fingerprint
        after = _run(llm)
        assert after == _run(fresh)
        assert after != before  # the new weights changed the outputs


def test_update_on_the_triton_kernels():
    kw = dict(BASE, backend="triton", block_size=8)
    with LLM("tiny-qwen3", mode="corun", seed=0, **kw) as llm, \
            LLM("tiny-qwen3", mode="corun", seed=1, **kw) as fresh:
        llm.update_weights(_weights("tiny-qwen3", seed=1))
        assert llm.system_fingerprint == fresh.system_fingerprint
        assert _run(llm) == _run(fresh)


def _save_checkpoint(seed: int, path, num_hidden_layers: int = 2) -> None:
    save_named_checkpoint("tiny-qwen3", seed, path, num_hidden_layers=num_hidden_layers)


def test_checkpoint_directory_update_equals_a_fresh_engine(tmp_path):
    _save_checkpoint(0, tmp_path / "a")
    _save_checkpoint(1, tmp_path / "b")
    with LLM(str(tmp_path / "a"), mode="corun", **BASE) as llm, \
            LLM(str(tmp_path / "b"), mode="corun", **BASE) as fresh:
        llm.update_weights(tmp_path / "b")
        assert llm.system_fingerprint == fresh.system_fingerprint
        assert _run(llm) == _run(fresh)


def test_the_policy_s_weights_after_a_step_load_and_match_its_logprobs():
    """A trainer's step, pushed to the engine: the engine then samples with the policy's new
    weights, and the policy scores those samples with the same bits."""
    with LLM("tiny-qwen3", mode="corun", **BASE) as llm:
        policy = Policy("tiny-qwen3", mode="corun", **{k: v for k, v in BASE.items()
                                                        if k != "skip_tokenizer_init"})
        torch.optim.SGD(policy.parameters(), lr=0.05).zero_grad()
        (-policy.sequence_logprobs(PROMPTS)[0].sum()).backward()
        torch.optim.SGD(policy.parameters(), lr=0.05).step()
        llm.update_weights(policy.checkpoint_weights())
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        trained = policy.completion_logprobs(PROMPTS, [o.outputs[0].token_ids for o in outs])
        for out, lp in zip(outs, trained, strict=True):
            assert torch.equal(torch.tensor(out.outputs[0].logprobs), lp.detach())


@pytest.mark.parametrize("break_it, match", [
    (lambda w: w.pop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), "shape mismatch .*model.norm"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(64, dtype=torch.int64)}),
     "dtype of 'model.norm.weight'"),
    (lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
])
def test_a_bad_update_changes_nothing(break_it, match):
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm:
        fingerprint, before = llm.system_fingerprint, _run(llm)
        weights = {k: v.clone() for k, v in _weights("tiny-qwen3", seed=1).items()}
        # Every tensor the copy would reach first is a good one: a partial copy would show.
        break_it(weights)
        with pytest.raises(CheckpointError, match=match):
            llm.update_weights(weights)
        assert llm.system_fingerprint == fingerprint
        assert _run(llm) == before


@pytest.mark.parametrize("make, match", [
    (lambda tmp: tmp / "missing", "no checkpoint directory"),
    (lambda tmp: _save_checkpoint(0, tmp / "deeper", num_hidden_layers=3) or tmp / "deeper",
     "describes another model: num_hidden_layers 3"),
])
def test_a_bad_directory_changes_nothing(tmp_path, make, match):
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm:
        fingerprint, before = llm.system_fingerprint, _run(llm)
        with pytest.raises(CheckpointError, match=match):
            llm.update_weights(make(tmp_path))
        assert llm.system_fingerprint == fingerprint and _run(llm) == before


def test_a_started_request_refuses_the_update_and_keeps_its_bits():
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm:
        alone = _run(llm)[0]
        engine = llm.engine
        request_id = engine.add_request(PROMPTS[0], PARAMS)
        engine.step()  # its first prefill chunk ran on the current weights
        with pytest.raises(RuntimeError, match="let them finish"):
            engine.update_weights(_weights("tiny-qwen3", seed=1))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        done = finals[request_id].outputs[0]
        assert (done.token_ids, done.fingerprint) == alone


def test_a_queued_request_runs_on_the_new_weights():
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm, \
            LLM("tiny-qwen3", mode="corun", seed=1, **BASE) as fresh:
        engine = llm.engine
        engine.add_request(PROMPTS[1], PARAMS, request_id="queued")  # not stepped yet
        engine.update_weights(_weights("tiny-qwen3", seed=1))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        expected = _run(fresh)[1]
        out = finals["queued"].outputs[0]
        assert (out.token_ids, out.fingerprint) == expected


def _shared_prefix_run(llm: LLM) -> tuple:
    prompt = PROMPTS[0] + [1, 2, 3]
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
    return out.outputs[0].fingerprint


def test_the_prefix_cache_never_serves_old_k_v():
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm, \
            LLM("tiny-qwen3", mode="corun", seed=1, **BASE) as fresh:
        _run(llm)  # caches PROMPTS[0]'s blocks under the old weights
        assert llm.engine.stats()["num_prefix_cached_blocks"] > 0
        llm.update_weights(_weights("tiny-qwen3", seed=1))
        hits = llm.engine.stats()["prefix_cache_hits"]
        assert _shared_prefix_run(llm) == _shared_prefix_run(fresh)
        assert llm.engine.stats()["prefix_cache_hits"] == hits  # nothing old was hit


def test_a_kept_prefix_cache_would_serve_old_k_v_negative_control(monkeypatch):
    """The check above can fail: with the reset skipped, the request after the update hits
    blocks the old weights computed, and its bits are not the fresh engine's."""
    from corun.kv_cache import BlockAllocator

    monkeypatch.setattr(BlockAllocator, "reset_prefix_cache", lambda self: 0)
    with LLM("tiny-qwen3", mode="corun", seed=0, **BASE) as llm, \
            LLM("tiny-qwen3", mode="corun", seed=1, **BASE) as fresh:
        _run(llm)
        llm.update_weights(_weights("tiny-qwen3", seed=1))
        hits = llm.engine.stats()["prefix_cache_hits"]
        assert _shared_prefix_run(llm) != _shared_prefix_run(fresh)
        assert llm.engine.stats()["prefix_cache_hits"] > hits


def test_tensor_parallel_update_equals_a_fresh_engine(tmp_path):
    """Two gloo ranks: named tensors broadcast from rank 0 and a checkpoint each rank reads
    load every shard; the fingerprint (over both ranks' shards) and the outputs are a fresh
    TP engine's."""
    kw = dict(BASE, tensor_parallel_size=2)
    _save_checkpoint(2, tmp_path / "c")
    with LLM("tiny-qwen3", mode="corun", seed=1, **kw) as fresh:  # one TP group at a time
        expected_fp, expected = fresh.system_fingerprint, _run(fresh)
    with LLM("tiny-qwen3", mode="corun", seed=0, **kw) as llm:
        llm.update_weights(_weights("tiny-qwen3", seed=1))
        assert llm.system_fingerprint == expected_fp
        assert _run(llm) == expected
        with pytest.raises(CheckpointError, match="missing tensor"):
            llm.update_weights({"model.norm.weight": torch.ones(64)})
        assert _run(llm) == expected  # the group still runs, on the same weights
        llm.update_weights(tmp_path / "c")
        after_disk = _run(llm)
    with LLM("tiny-qwen3", mode="corun", seed=2, **kw) as fresh:
        assert after_disk == _run(fresh)
