"""Load a HF checkpoint directory (config.json + safetensors) into a CoRun model.

Names are mapped by whole dotted names, never substrings: the model declares which HF modules it
fuses (``packed_modules_mapping``: q/k/v -> qkv_proj, gate/up -> gate_up_proj), and the loader
builds the exact set of checkpoint keys it expects from the model's own parameters:

- a plain parameter or persistent buffer: its own name;
- a fused linear: ``<prefix>.<hf module>.weight`` per shard, written into that shard's rows;
- fused experts ``<prefix>.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]: either
  the v5 fused keys themselves, or the Hub's per-expert ``<prefix>.experts.{e}.gate_proj`` /
  ``up_proj`` / ``down_proj`` ``.weight`` (gate rows first, as vLLM and transformers v5 stack).

A model may also declare ``checkpoint_renames`` (checkpoint fragment -> our fragment, whole
dotted components, the first rule that matches): Hy3's Hub files name the router
``mlp.router.gate``, the correction bias ``mlp.expert_bias`` (transformers v5:
``mlp.e_score_correction_bias``) and the shared expert ``mlp.shared_mlp``. Two checkpoint keys
that rename to one tensor are an error.

Keys of layers >= num_hidden_layers (DeepSeek-V3's MTP layer 61, Hy3's 80) are skipped, as is
``lm_head.weight`` when the embeddings are tied. Everything is validated from the safetensors
headers first (unexpected keys, shapes, missing keys) and only then streamed tensor by tensor onto
the target device and dtype, so a bad checkpoint fails before any weight is copied, with a
``CheckpointError`` naming the problem; nothing half-loaded is returned.

Tensor parallelism: each checkpoint key covers a region of a full (TP=1) parameter; the loader
intersects it with the pieces of the parameter's ``ShardLayout`` that this rank holds and reads
only those slices (``safe_open(...).get_slice(key)[...]``), so a rank never materialises another
rank's weights. Shapes are still validated against the full checkpoint tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.config import ModelConfig
from models.layers.linear import ColumnParallelLinear
from models.layers.moe import FusedExperts
from models.parallel import SINGLE, ParallelContext
from models.weights import Index, ShardLayout, shard_layout


class CheckpointError(ValueError):
    """A checkpoint directory this loader cannot turn into a model; the message says why."""


@dataclass(frozen=True)
class _Copy:
    """``param[local_index] = checkpoint_tensor[source_index]``."""

    param_name: str
    local_index: Index
    source_index: Index


@dataclass(frozen=True)
class _Target:
    """What one checkpoint tensor (which must have ``shape``) feeds on this rank: ``region`` of
    the full (TP=1) parameter ``param_name``, this rank's part of it through ``copies``."""

    shape: tuple[int, ...]
    copies: tuple[_Copy, ...]
    param_name: str = ""
    region: tuple = ()


def _ranges(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """(start, stop, is_int_index) per dim of ``shape`` for an index of ints and unit slices."""
    out = []
    for dim, size in enumerate(shape):
        item = index[dim] if dim < len(index) else slice(None)
        if isinstance(item, int):
            out.append((item, item + 1, True))
        else:
            start, stop, _ = item.indices(size)
            out.append((start, stop, False))
    return out


def _target(param_name: str, layout: ShardLayout, region: tuple) -> _Target:
    """The checkpoint tensor ``full[region]`` of a parameter, intersected with this rank's
    pieces (int entries of ``region`` are dims the checkpoint tensor does not have)."""
    full = layout.full_shape
    reg = _ranges(region, full)
    copies = []
    for local_index, full_index in layout.pieces:
        local, source = [], []
        for dim, ((r0, r1, dropped), (p0, p1, _)) in enumerate(
                zip(reg, _ranges(full_index, full), strict=True)):
            start, stop = max(r0, p0), min(r1, p1)
            if start >= stop:
                break
            # Pieces are unit slices; a local dim the piece leaves whole starts at 0.
            local_offset = (local_index[dim].start or 0) if dim < len(local_index) else 0
            local_start = local_offset + start - p0
            local.append(slice(local_start, local_start + stop - start))
            if not dropped:
                source.append(slice(start - r0, stop - r0))
        else:
            copies.append(_Copy(param_name, tuple(local), tuple(source)))
    return _Target(tuple(r1 - r0 for r0, r1, dropped in reg if not dropped), tuple(copies),
                   param_name, region)


def _expected_keys(model: nn.Module) -> tuple[dict[str, _Target], dict[str, list[list[str]]]]:
    """(checkpoint key -> target, param -> alternative key sets that each fully cover it)."""
    targets: dict[str, _Target] = {}
    coverage: dict[str, list[list[str]]] = {}
    packed = getattr(model, "packed_modules_mapping", {})
    shards_of: dict[str, list[tuple[str, int]]] = {}
    for hf_name, (fused, shard) in packed.items():
        shards_of.setdefault(fused, []).append((hf_name, shard))
    owners = dict(model.named_modules())
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if _is_persistent(owners, n))
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        owner = owners[prefix]
        layout = shard_layout(owner, leaf, tensor)
        module_prefix, _, module_name = prefix.rpartition(".")
        keys: list[str] = []
        if (isinstance(owner, ColumnParallelLinear) and module_name in shards_of
                and leaf in ("weight", "bias")):
            for hf_name, shard in shards_of[module_name]:
                key = ".".join(p for p in (module_prefix, hf_name, leaf) if p)
                targets[key] = _target(name, layout, (owner.shard_rows(shard),))
                keys.append(key)
            coverage[name] = [keys]
            continue
        targets[name] = _target(name, layout, ())
        coverage[name] = [[name]]
        if isinstance(owner, FusedExperts):
            inter = owner.intermediate_size
            for e in range(owner.num_experts):
                if leaf == "gate_up_proj":
                    for hf_name, rows in (("gate_proj", slice(0, inter)),
                                          ("up_proj", slice(inter, 2 * inter))):
                        key = f"{prefix}.{e}.{hf_name}.weight"
                        targets[key] = _target(name, layout, (e, rows))
                        keys.append(key)
                else:
                    key = f"{prefix}.{e}.down_proj.weight"
                    targets[key] = _target(name, layout, (e,))
                    keys.append(key)
            coverage[name].append(keys)
    return targets, coverage


def checkpoint_views(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """The model's weights as a checkpoint would name them, each a view of this rank's tensor:
    a fused linear's shards under their HF module names, fused experts under the v5 names,
    everything else under its own (what ``load_weights`` and ``LLM.update_weights`` take back).
    ``tensors`` (parameter name -> tensor of the parameter's shape, e.g. gradients) are viewed
    instead of the parameters. Tensor parallel size 1 (a rank's shard is not a checkpoint
    tensor)."""
    if getattr(model, "parallel", None) is not None and model.parallel.is_parallel:
        raise ValueError("model: a tensor-parallel rank holds shards, not checkpoint tensors")
    targets, coverage = _expected_keys(model)
    source = dict(model.named_parameters())
    owners = dict(model.named_modules())
    source.update((n, b) for n, b in model.named_buffers() if _is_persistent(owners, n))
    if tensors is not None:
        source = {name: tensors[name] for name in source if name in tensors}
    return {key: source[param][targets[key].region]
            for param, alternatives in coverage.items() if param in source
            for key in alternatives[0]}


def _rename(key: str, renames: dict[str, str]) -> str:
    """``key`` with the first matching fragment of ``renames`` replaced (whole components)."""
    parts = key.split(".")
    for source, target in renames.items():
        src = source.split(".")
        for i in range(len(parts) - len(src) + 1):
            if parts[i : i + len(src)] == src:
                return ".".join(parts[:i] + target.split(".") + parts[i + len(src):])
    return key


def _is_persistent(owners: dict[str, nn.Module], buffer_name: str) -> bool:
    prefix, _, leaf = buffer_name.rpartition(".")
    return leaf not in owners[prefix]._non_persistent_buffers_set


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """checkpoint key -> file, from the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"unreadable file {index}: {exc}") from exc
        return {key: path / file for key, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {path}")
    return {key: file for file in files for key in _file_keys(file)}


def _file_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise CheckpointError(f"unreadable file {file}: {exc}") from exc


def _match_keys(model: nn.Module, config: ModelConfig, keys: list[str],
                where: dict[str, str] | None = None) -> tuple[dict[str, _Target], dict[str, str]]:
    """Each checkpoint key's target (keys of layers past the model's depth, and a tied
    ``lm_head.weight``, skipped); every parameter must be covered. CheckpointError names the
    first key the model has no tensor for, two keys that feed one tensor, or a missing one."""
    targets, coverage = _expected_keys(model)
    renames = getattr(model, "checkpoint_renames", {})
    found: dict[str, _Target] = {}
    source_of: dict[str, str] = {}  # our name -> the checkpoint key that feeds it
    for key in keys:
        layer = _layer_index(key)
        if layer is not None and layer >= config.num_hidden_layers:
            continue  # e.g. DeepSeek-V3's MTP layer 61, which HF ignores too
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = _rename(key, renames)
        if name not in targets:
            place = f" in {where[key]}" if where else ""
            raise CheckpointError(f"unexpected tensor {key!r}{place}: the model has no such "
                                  f"weight")
        if name in source_of:
            raise CheckpointError(f"tensors {source_of[name]!r} and {key!r} both load {name!r}")
        source_of[name] = key
        found[key] = targets[name]
    seen = set(source_of)
    for param, alternatives in coverage.items():
        if not any(all(k in seen for k in keys) for keys in alternatives):
            first_missing = next(k for k in alternatives[0] if k not in seen)
            raise CheckpointError(f"missing tensor {first_missing!r} (for parameter {param})")
    return found, source_of


def plan_tensors(model: nn.Module, config: ModelConfig,
                 tensors: dict[str, torch.Tensor]) -> dict[str, _Target]:
    """Validate named tensors (checkpoint names, as ``load_weights`` reads them from files)
    against the model, before any is copied: every name known and every weight covered, each
    shape the checkpoint shape, each dtype floating point (copies cast to the weight's dtype,
    as a checkpoint in another dtype loads). CheckpointError naming the first bad tensor."""
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"tensor {key!r}: expected a torch.Tensor, got "
                                  f"{type(tensor).__name__}")
    found, _ = _match_keys(model, config, list(tensors))
    for key, target in found.items():
        tensor = tensors[key]
        if tuple(tensor.shape) != target.shape:
            raise CheckpointError(f"shape mismatch for {key!r}: expected {target.shape}, "
                                  f"found {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"dtype of {key!r}: expected a floating-point tensor, found "
                                  f"{tensor.dtype}")
    return found


def copy_tensors(model: nn.Module, plan: dict[str, _Target],
                 tensors: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of validated named tensors (``plan_tensors``) into the model's
    own storage (in place: captured CUDA graphs keep reading it)."""
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    with torch.no_grad():
        for key, target in plan.items():
            for copy in target.copies:
                own[copy.param_name][copy.local_index].copy_(tensors[key][copy.source_index])


def _plan(model: nn.Module, config: ModelConfig,
          files: dict[str, Path]) -> dict[Path, list[tuple[str, _Target]]]:
    """Validate every key against the model (from headers only); group the copies by file."""
    from safetensors import safe_open

    found, _ = _match_keys(model, config, list(files), {k: f.name for k, f in files.items()})
    by_file: dict[Path, list[tuple[str, _Target]]] = {}
    for key, target in found.items():
        by_file.setdefault(files[key], []).append((key, target))
    for file, entries in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for key, target in entries:
                    if key not in present:
                        raise CheckpointError(f"missing tensor {key!r}: the index names "
                                              f"{file.name}, which does not hold it")
                    found_shape = tuple(f.get_slice(key).get_shape())
                    if found_shape != target.shape:
                        raise CheckpointError(f"shape mismatch for {key!r}: expected "
                                              f"{target.shape}, found {found_shape}")
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"unreadable file {file}: {exc}") from exc
    return by_file


@torch.no_grad()
def load_weights(model: nn.Module, config: ModelConfig, path: str | os.PathLike) -> None:
    """Validate the checkpoint at ``path`` against ``model``, then copy this rank's slices of it
    in tensor by tensor."""
    from safetensors import safe_open

    plan = _plan(model, config, _checkpoint_files(Path(path)))
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for file, entries in plan.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, target in entries:
                if not target.copies:
                    continue
                tensor_slice = f.get_slice(key)
                for copy in target.copies:
                    # Only this rank's slice is read; copy_ casts to the parameter's dtype on its
                    # device (an int-indexed dim of the parameter broadcasts from the slice).
                    tensors[copy.param_name][copy.local_index].copy_(
                        tensor_slice[copy.source_index])


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a HF directory's config.json; CheckpointError if there is none."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable file {path / 'config.json'}: {exc}") from exc
    try:
        return ModelConfig.from_hf(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc


def check_checkpoint(model: nn.Module, config: ModelConfig, path: str | os.PathLike) -> None:
    """That ``path`` holds new weights for this very model, before any is read: its
    config.json describes the same model (token ids aside), and its tensors' names and shapes
    (from the safetensors headers) are the model's. CheckpointError naming the difference."""
    other = checkpoint_config(path)
    ignore = {"bos_token_id", "eos_token_id"}
    for field in dataclasses.fields(ModelConfig):
        if field.name in ignore:
            continue
        ours, theirs = getattr(config, field.name), getattr(other, field.name)
        if ours != theirs:
            raise CheckpointError(f"{Path(path) / 'config.json'} describes another model: "
                                  f"{field.name} {theirs!r}, this one's {ours!r}")
    _plan(model, config, _checkpoint_files(Path(path)))


def load_model(path: str | os.PathLike, *, dtype: torch.dtype, device: torch.device | str,
               parallel: ParallelContext = SINGLE) -> tuple[nn.Module, ModelConfig]:
    """Build the model a HF directory describes (this rank's shard under ``parallel``) and load
    its weights; CheckpointError if not."""
    from models import create_model

    config = checkpoint_config(path)
    model = create_model(config, dtype=dtype, device=device, parallel=parallel)
    load_weights(model, config, path)
    model.process_weights_after_loading()
    return model, config
