"""``python -m corun.serve`` flags: --help explains each one; a bad value exits naming it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from corun.serve import build_parser, engine_config_kwargs
from tests.api.conftest import REPO_ROOT

FLAGS = [
    "--model",
    "--mode",
    "--host",
    "--port",
    "--max-num-seqs",
    "--max-model-len",
    "--decode-batch-size",
    "--dtype",
    "--seed",
    "--api-key",
    "--max-queue-len",
    "--enable-prefix-caching",
]


def test_help_explains_every_flag():
    result = subprocess.run(
        [sys.executable, "-m", "corun.serve", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for flag in FLAGS:
        assert flag in result.stdout
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_flags_map_to_engine_config():
    args = build_parser().parse_args(
        [
            "--mode",
            "batch_invariant",
            "--max-num-seqs",
            "4",
            "--decode-batch-size",
            "4",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--seed",
            "9",
        ]
    )
    kwargs = engine_config_kwargs(args)
    assert kwargs["model"] == "corun-default" and kwargs["mode"] == "batch_invariant"
    assert (kwargs["max_num_seqs"], kwargs["decode_batch_size"], kwargs["seed"]) == (4, 4, 9)
    assert kwargs["dtype"] == "float32" and kwargs["device"] == "cpu"


def test_prefix_caching_flag_defaults_to_the_engine_config_and_turns_off():
    from corun.config import EngineConfig

    parser = build_parser()
    default = engine_config_kwargs(parser.parse_args([]))["enable_prefix_caching"]
    assert default is EngineConfig().enable_prefix_caching is True
    off = engine_config_kwargs(parser.parse_args(["--no-enable-prefix-caching"]))
    assert off["enable_prefix_caching"] is False
    assert EngineConfig(**dict(off, device="cpu")).prefix_cache_granularity is None
    on = engine_config_kwargs(parser.parse_args(["--enable-prefix-caching"]))
    assert on["enable_prefix_caching"] is True
    assert "--no-enable-prefix-caching" in parser.format_help()


def test_invalid_flag_value_exits_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "corun.serve", "--max-num-seqs", "0", "--device", "cpu"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "max_num_seqs" in result.stderr


def _help_blocks() -> dict[str, str]:
    """--help text per option: from its '  --flag' line to the next option's."""
    blocks: dict[str, str] = {}
    current = None
    for line in build_parser().format_help().splitlines():
        match = re.match(r"^  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_help_shows_one_default_per_flag():
    blocks = _help_blocks()
    assert {"--port", "--max-queue-len", "--shutdown-timeout-s"} <= set(blocks)
    for flag, text in blocks.items():
        assert text.count("default:") <= 1, f"{flag}: {text}"
    assert "(default: 8000)" in blocks["--port"]
    assert "(default: 30.0)" in blocks["--shutdown-timeout-s"]
    from corun.api.server import DEFAULT_MAX_REQUEST_BODY_BYTES

    assert build_parser().get_default("max_request_body_bytes") == DEFAULT_MAX_REQUEST_BODY_BYTES
    # The API key's value (from the environment) is never printed.
    assert "default: None" not in blocks["--api-key"]


def test_readme_says_how_to_change_the_port():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "--port 9000" in readme and "make serve ARGS='--port 9000'" in readme


def test_packaging_metadata_builds_without_deprecation_warnings(tmp_path):
    """The license is an SPDX string (PEP 639): setuptools warns about the old table form."""
    assert 'license = "Apache-2.0"' in (REPO_ROOT / "pyproject.toml").read_text()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    (tmp_path / "corun").mkdir()
    (tmp_path / "corun" / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    script = (
        "import warnings\n"
        "from setuptools import build_meta\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    build_meta.prepare_metadata_for_build_wheel('out')\n"
        "print('WARNINGS', [str(w.message).splitlines()[0] for w in caught])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "WARNINGS []" in result.stdout, result.stdout[-2000:]


def test_serving_defaults_differ_from_the_engine_only_where_the_serving_sweep_chose():
    """The server's packed step is the serving sweep's (T = 1024, stall budget T, C = 512);
    every other flag falls back to EngineConfig's default, and an explicit flag still wins."""
    from corun.config import ENGINE_DEFAULTS
    from corun.serve import SERVE_DEFAULTS

    changed = {k for k in SERVE_DEFAULTS if SERVE_DEFAULTS[k] != ENGINE_DEFAULTS[k]}
    assert changed == {"prefill_chunk_size", "prefill_step_tokens", "prefill_token_budget"}
    kwargs = engine_config_kwargs(build_parser().parse_args([]))
    assert (kwargs["prefill_chunk_size"], kwargs["prefill_step_tokens"],
            kwargs["prefill_token_budget"]) == (512, 1024, 1024)
    for field in ("prefill_policy", "max_prefill_seqs_per_step", "decode_split_size"):
        assert kwargs[field] == ENGINE_DEFAULTS[field]
    offline = engine_config_kwargs(build_parser().parse_args(
        ["--prefill-step-tokens", "8192", "--prefill-token-budget", "8192"]))
    assert (offline["prefill_step_tokens"], offline["prefill_token_budget"]) == (8192, 8192)


def _serve(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corun.serve", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_missing_model_path_is_named_before_anything_loads():
    result = _serve("--model", "/no/such/dir", "--port", "0")
    assert result.returncode != 0
    assert "--model: no directory '/no/such/dir'" in result.stderr
    assert "RANDOM WEIGHTS" not in result.stderr and "named config:" not in result.stderr


def test_a_hub_id_says_hub_ids_are_not_downloaded():
    result = _serve("--model", "Qwen/Qwen3-0.6B")
    assert result.returncode != 0
    assert "Hugging Face Hub ids are not downloaded" in result.stderr
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in result.stderr


def test_a_port_in_use_is_refused_before_the_model_loads():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _serve("--port", str(port), "--device", "cpu", timeout=60)
    assert result.returncode != 0
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "listening on" not in result.stderr and "RANDOM WEIGHTS" not in result.stderr


def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a CUDA device: the refusal is for machines without one")
    result = _serve("--device", "cuda", "--port", "0")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("--device cuda: this torch sees no")
    assert "Traceback" not in result.stderr


def test_gpu_memory_utilization_is_a_flag():
    args = build_parser().parse_args(["--gpu-memory-utilization", "0.5"])
    assert engine_config_kwargs(args)["gpu_memory_utilization"] == 0.5


def test_a_tokenizer_much_smaller_than_the_vocabulary_is_warned_about(caplog):
    """A checkpoint whose config vocabulary (151,936 ids) dwarfs its tokenizer's (259): every
    sampled id past the tokenizer decodes to '', so the server says so at startup."""
    import logging

    from corun.serve import warn_vocab_mismatch
    from corun.tokenizer import tokenizer_for_model

    byte_level = tokenizer_for_model("corun-default")[0]
    with caplog.at_level(logging.WARNING, logger="corun.serve"):
        warn_vocab_mismatch(byte_level, "qwen3-0.6b")
    assert "vocabulary has 151936 ids, its tokenizer knows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="corun.serve"):
        warn_vocab_mismatch(byte_level, "corun-default")  # its own: 384 rows, 259 tokens
    assert caplog.text == ""
