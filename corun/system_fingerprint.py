"""The system fingerprint: one id for everything that decides a response's bits.

Two responses (or two offline runs) are comparable bit for bit exactly when their system
fingerprints are equal: the id hashes the weights (a digest of the bits the engine holds,
``models.weights.weights_digest``, so an engine whose weights were updated has the id of a
fresh one built on the same weights; a config alone names them by named config and seed, or by
a digest of the checkpoint's files), the dtype, the mode and backend, the step shapes (B and the
decode buckets, the prefill policy with C, T and R, the block size, max_model_len, which bounds
the decode grid), the decode split size and path invariance, the tuned kernel tables the
device's card reads, the source of the kernels, models and engine (so a change of the code that
decides the bits, e.g. a kernel's order of addition, changes the id even at one version number;
a comment edit changes it too, which errs on the safe side), tensor parallelism, the EOS ids,
the device (GPU name and compute capability, or the CPU's vector ISA) and the torch / triton /
corun / outlines-core versions (outlines-core compiles structured output's grammars, so it
decides which tokens a structured request may sample). Pure sizing and pacing knobs (KV block
count, queue length, token budgets, overlap, CUDA graphs, which replay the eager bits, decode
attention's fused combine) are left out: they do not change a request's bits.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from corun.config import EngineConfig
from kernels.mode import Mode

_ROOT = Path(__file__).resolve().parents[1]
_TUNED_DIR = _ROOT / "kernels" / "tuned"
# The packages whose code decides a response's bits: the kernels, the models, the engine.
_SOURCE_DIRS = (_ROOT / "kernels", _ROOT / "models", _ROOT / "corun")
# A checkpoint's weights are identified by each file's name, size and its first and last bytes
# (hashing many GB at every start-up would be too slow); config.json is hashed whole.
_EDGE_BYTES = 1 << 20


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE_BYTES))
        if size > _EDGE_BYTES:
            f.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
            h.update(f.read())
    return h.hexdigest()


def weights_id(config: EngineConfig) -> str:
    from models import NAMED_CONFIGS

    if config.model in NAMED_CONFIGS:
        return f"{config.model}:seed={config.seed}"
    root = Path(config.model)
    files = sorted(p for p in root.iterdir()
                   if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    return "ckpt:" + hashlib.sha256(
        "".join(_file_digest(p) for p in files).encode()).hexdigest()[:32]


def _files_digest(files: Iterable[tuple[str, Path]]) -> str:
    """sha256 over (name, bytes) of each file, in the order given."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tuned_table_files(card: str | None, tuned_dir: Path | None = None) -> list[Path]:
    """The tuned tables an engine on ``card`` reads (``kernels.utils.device_card``): every table
    but another card's GEMM table (``kernels.gemm.table_files``), so re-tuning the H100's GEMMs
    leaves an H200's fingerprint, whose bits it does not touch, as it was."""
    from kernels.gemm import table_files

    gemm_files = {path.name for path in table_files(card)}
    return [path for path in sorted((tuned_dir or _TUNED_DIR).glob("*.json"))
            if not path.name.startswith("gemm_") or path.name in gemm_files]


def _card(config: EngineConfig) -> str | None:
    from kernels.utils import device_card

    return device_card(torch.device(config.resolved_device))


def _tuned_tables(config: EngineConfig) -> str:
    return _files_digest((p.name, p) for p in tuned_table_files(_card(config)))


def source_digest(dirs: tuple[Path, ...] = _SOURCE_DIRS) -> str:
    """The digest of every .py file under ``dirs`` (relative path and bytes, sorted)."""
    return _files_digest((str(p.relative_to(root.parent)), p)
                         for root in dirs for p in sorted(root.rglob("*.py")))


def _device(config: EngineConfig) -> str:
    device = torch.device(config.resolved_device)
    if device.type == "cuda":
        index = device.index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for package in ("triton", "corun", "outlines-core"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "none"
    return out


def describe(config: EngineConfig, eos_token_ids: frozenset[int] | tuple = (),
             dynamic_step_tokens: list[int] | None = None,
             weights_digest: str | None = None) -> dict[str, object]:
    """What decides the bits of this engine's responses, as plain values (``eos_token_ids``: the
    engine's, from the model config and the tokenizer: where generation stops;
    ``dynamic_step_tokens``: the runner's, ``ModelRunner.dynamic_step_tokens``, which knows the
    model; the config's resolved value when not given; ``weights_digest``: the runner's
    ``weights_digest`` of the weights it holds, which an engine always passes: the same for a
    fresh engine and one updated to the same weights; without it, the config's name of them)."""
    if dynamic_step_tokens is None:
        dynamic_step_tokens = config.dynamic_step_tokens
    return {
        "weights": weights_id(config) if weights_digest is None else f"bits:{weights_digest}",
        "eos_token_ids": sorted(eos_token_ids),
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "mode": config.kernel_mode.value,
        "backend": config.resolved_backend,
        "decode_buckets": list(config.decode_buckets),
        "prefill_policy": config.prefill_policy if config.is_corun else None,
        "prefill_chunk_size": config.prefill_chunk_size,
        "prefill_step_tokens": config.prefill_step_tokens if config.is_packed_prefill else None,
        "max_prefill_seqs_per_step":
            config.max_prefill_seqs_per_step if config.is_packed_prefill else None,
        "prefill_buckets": list(config.prefill_buckets) if config.is_corun else None,
        "max_num_batched_tokens": None if config.is_corun else config.max_num_batched_tokens,
        # default runs its kernels at the padded shapes of its small steps; the batch-invariant
        # modes keep their bits under the padding (tests/engine/test_dynamic_buckets.py).
        "dynamic_step_tokens":
            list(dynamic_step_tokens) if config.kernel_mode is Mode.DEFAULT else None,
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "decode_split_size": config.decode_split_size,
        "path_invariant": config.is_path_invariant,
        "tensor_parallel_size": config.tensor_parallel_size,
        "tuned_tables": _tuned_tables(config),
        "sources": source_digest(),
        "device": _device(config),
        **_versions(),
    }


def system_fingerprint(config: EngineConfig, eos_token_ids: frozenset[int] | tuple = (),
                       dynamic_step_tokens: list[int] | None = None,
                       weights_digest: str | None = None) -> str:
    """``fp_`` and 16 hex digits of the sha256 of ``describe``."""
    text = json.dumps(describe(config, eos_token_ids, dynamic_step_tokens, weights_digest),
                      sort_keys=True)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:16]
