"""CoRun models: Qwen3, Qwen3-MoE, DeepSeek-V3 and Hy3 built from shared layers.

``build_model(name_or_path, dtype=..., device=...)`` returns ``(model, ModelConfig)``: a name from
``NAMED_CONFIGS`` gives seeded random weights, a directory loads a HF checkpoint. The model runs
``model(input_ids, batch)`` -> hidden and ``model.compute_logits(hidden)``; how it computes
(backend, mode) travels in ``batch.ops``.

Tensor parallelism: pass ``parallel=ParallelContext(rank, world_size, group)`` (``models.parallel``)
and each rank builds and loads only its shard; random weights are the shards of the same full
weights a TP=1 build draws from ``seed``.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import torch
from torch import nn

from models.config import NAMED_CONFIGS, ModelConfig
from models.parallel import SINGLE, ParallelContext

# HF architecture name -> (module, class), imported only when used.
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "HYV3ForCausalLM": ("models.hy3", "HYV3ForCausalLM"),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The CoRun class of a HF architecture name; ValueError for an unsupported one."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture: unsupported {architecture!r}; "
                         f"expected one of {sorted(MODEL_REGISTRY)}")
    module_name, class_name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module_name), class_name)


def create_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 parallel: ParallelContext = SINGLE) -> nn.Module:
    """Construct this rank's shard on the meta device and materialise it on ``device`` (weights
    uninitialised)."""
    from models.weights import materialize

    with torch.device("meta"):
        model = model_class(config.architecture)(config, parallel)
    return materialize(model, dtype, device).eval()


def check_model_source(name_or_path: str | os.PathLike) -> None:
    """A named config or a checkpoint directory, else ValueError saying which it is not: a path
    that does not exist, or a Hugging Face Hub id (never downloaded here)."""
    name = str(name_or_path)
    if name in NAMED_CONFIGS or Path(name).is_dir():
        return
    known = ", ".join(NAMED_CONFIGS)
    if Path(name).exists():
        why = f"{name!r} is a file, not a checkpoint directory"
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        why = (f"{name!r} is not a local directory; Hugging Face Hub ids are not downloaded: "
               f"fetch the checkpoint first (`huggingface-cli download {name} --local-dir DIR`) "
               f"and pass DIR")
    else:
        why = f"no directory {name!r}"
    raise ValueError(f"{why} (a model is a checkpoint directory or one of the named configs: "
                     f"{known})")


def build_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype,
                device: torch.device | str, seed: int = 0,
                parallel: ParallelContext = SINGLE) -> tuple[nn.Module, ModelConfig]:
    """A named config with random weights drawn from ``seed``, or a HF checkpoint directory;
    this rank's shard under ``parallel``."""
    from models.weights import init_random_weights

    name = str(name_or_path)
    if name in NAMED_CONFIGS:
        config = NAMED_CONFIGS[name]
        model = create_model(config, dtype=dtype, device=device, parallel=parallel)
        init_random_weights(model, config.num_hidden_layers, seed)
        model.process_weights_after_loading()
        return model, config
    if Path(name).is_dir():
        from models.loader import load_model

        return load_model(name, dtype=dtype, device=device, parallel=parallel)
    check_model_source(name)
    raise AssertionError("unreachable: check_model_source raised")


__all__ = ["MODEL_REGISTRY", "NAMED_CONFIGS", "ModelConfig", "ParallelContext", "build_model",
           "create_model", "model_class"]
