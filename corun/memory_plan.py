"""Memory planning before anything is allocated: how many KV blocks a config can use, what the
weights and that cache take, and a clear error when they cannot fit.

The KV cache is sized to what the config can use (``config_num_blocks``): every one of
``max_num_seqs`` sequences at ``max_model_len``, plus one more sequence of margin, so a tiny model
on a large GPU takes a few MB, not the whole GPU (and a second engine in the same process can
start). ``num_kv_blocks`` overrides it; an explicit ``gpu_memory_utilization`` sizes the cache from
free GPU memory instead (the benchmarks' way to give preemption room).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from corun.config import EngineConfig

GIB = 1 << 30
# Beyond the weights and the KV cache: activations, step buffers, allocator slack.
_CPU_MARGIN_BYTES = 1 << 30


def config_num_blocks(config: EngineConfig) -> int:
    """KV blocks the config can use at once: ``max_num_seqs`` full-length sequences, plus one
    sequence of margin."""
    return (config.max_num_seqs + 1) * config.max_blocks_per_seq


# Kept free beyond the profiled peak when sizing the cache from free GPU memory: the step graphs'
# pools and allocator fragmentation.
GPU_RESERVE_BYTES = 2 << 30
# The fraction of the GPU a cache sized from free memory may fill when none is given.
DEFAULT_GPU_UTILIZATION = 0.9


def gpu_num_blocks(config: EngineConfig, free: int, total: int, peak: int,
                   per_block: int) -> int:
    """The KV blocks of a GPU engine without ``num_kv_blocks``: what the config can use
    (``config_num_blocks``) when it fits, or with an explicit ``gpu_memory_utilization`` as many
    as that fraction of the GPU leaves after the weights, the activation ``peak`` and a reserve.
    ValueError when not even one ``max_model_len`` sequence fits."""
    utilization = config.gpu_memory_utilization
    budget = total * (utilization or DEFAULT_GPU_UTILIZATION) - (total - free) - peak
    num_blocks = int((budget - GPU_RESERVE_BYTES) // per_block)
    if utilization is None:
        num_blocks = min(num_blocks, config_num_blocks(config))
    if num_blocks * config.block_size < config.max_model_len:
        raise ValueError(
            f"gpu_memory_utilization: {utilization or DEFAULT_GPU_UTILIZATION} of "
            f"{total / GIB:.1f} GiB ({free / GIB:.1f} GiB free) leaves room for "
            f"{max(num_blocks, 0)} KV blocks, less than one max_model_len sequence: free GPU "
            f"memory, or lower max_model_len")
    return num_blocks


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_block: int
    num_kv_blocks: int  # the blocks the plan allocates (on a GPU: at least one sequence's)

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_block * self.num_kv_blocks

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


def cuda_peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """CUDA bytes ``run()`` allocates at its peak above what was allocated before it: the
    device synchronized on both sides, so the peak counts the work ``run`` queued."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def model_config_of(name: str):
    """The ModelConfig of a named config or a checkpoint's config.json; None when unreadable
    (building the model then reports why)."""
    from models import NAMED_CONFIGS
    from models.config import ModelConfig

    if name in NAMED_CONFIGS:
        return NAMED_CONFIGS[name]
    try:
        return ModelConfig.from_hf(json.loads(Path(name, "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kv_bytes_per_block(model_config, config: EngineConfig) -> int:
    """One block of this rank's KV shard (MHA: K and V per KV head; MLA: the latent entry)."""
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    if model_config.is_mla:
        per_token = model_config.kv_lora_rank + model_config.qk_rope_head_dim
    else:
        heads = max(1, model_config.num_key_value_heads // config.tensor_parallel_size)
        per_token = 2 * heads * model_config.head_dim
    return model_config.num_hidden_layers * config.block_size * per_token * elem


def plan(config: EngineConfig, model_config) -> MemoryPlan:
    from models.config import num_parameters

    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    weights = num_parameters(model_config) * elem // config.tensor_parallel_size
    per_block = kv_bytes_per_block(model_config, config)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.resolved_device.startswith("cuda"):
        blocks = config.max_blocks_per_seq  # the least a GPU cache sized from free memory takes
    else:
        blocks = config_num_blocks(config)
    return MemoryPlan(weights, per_block, blocks)


def available_bytes(device: torch.device) -> int:
    """Free GPU memory, or the host's available memory (psutil, else /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell the available host memory (no psutil, no /proc/meminfo)")


def check_fits(memory: MemoryPlan, available: int, config: EngineConfig) -> None:
    """ValueError naming what to change when the plan exceeds ``available`` bytes."""
    margin = 0 if config.resolved_device.startswith("cuda") else _CPU_MARGIN_BYTES
    if memory.total_bytes + margin <= available:
        return
    raise ValueError(
        f"model: {config.model} in {config.torch_dtype} needs about "
        f"{memory.total_bytes / GIB:.1f} GiB ({memory.weights_bytes / GIB:.1f} GiB of weights, "
        f"{memory.kv_bytes / GIB:.1f} GiB of KV cache for {memory.num_kv_blocks} blocks) but "
        f"{available / GIB:.1f} GiB are available on {config.resolved_device}: use a smaller "
        f"model, a smaller dtype, fewer max_num_seqs / a shorter max_model_len or num_kv_blocks, "
        f"or tensor_parallel_size > 1")
