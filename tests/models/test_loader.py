"""Loader: sharded checkpoints load, and each bad checkpoint raises CheckpointError naming the
problem (unsupported architecture, missing / unexpected tensor, shape mismatch, unreadable file)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import CheckpointError, load_model
from tests.models.test_qwen3_parity import make_hf_qwen3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    make_hf_qwen3(tie=False).save_pretrained(path)
    return path


@pytest.fixture
def ckpt(checkpoint, tmp_path):
    """A private copy of the checkpoint that a test may corrupt."""
    return shutil.copytree(checkpoint, tmp_path / "ckpt")


def edit_tensors(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_sharded_checkpoint_matches_single_file(checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    make_hf_qwen3(tie=False).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ours, _ = load_model(sharded, dtype=torch.float32, device="cpu")
    single, _ = load_model(checkpoint, dtype=torch.float32, device="cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), single.state_dict().items(),
                                     strict=True):
        assert torch.equal(a, b), name


def test_unsupported_architecture(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported 'LlamaForCausalLM'"):
        load_model(ckpt, dtype=torch.float32, device="cpu")


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj"):
        load_model(ckpt, dtype=torch.float32, device="cpu")


def test_unexpected_tensor(ckpt):
    extra = {"model.layers.0.self_attn.extra.weight": torch.ones(2)}
    edit_tensors(ckpt, lambda t: t.update(extra))
    with pytest.raises(CheckpointError,
                       match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra"):
        load_model(ckpt, dtype=torch.float32, device="cpu")


def test_shape_mismatch(ckpt):
    wrong = {"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}
    edit_tensors(ckpt, lambda t: t.update(wrong))
    with pytest.raises(CheckpointError,
                       match=r"shape mismatch for 'model\.layers\.0\.self_attn\.q_norm\.weight': "
                             r"expected \(16,\), found \(8,\)"):
        load_model(ckpt, dtype=torch.float32, device="cpu")


def test_unreadable_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable file"):
        load_model(ckpt, dtype=torch.float32, device="cpu")


def test_unreadable_config(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="unreadable file .*config.json"):
        load_model(ckpt, dtype=torch.float32, device="cpu")
