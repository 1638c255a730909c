"""``python -m corun.serve`` flags: --help explains each one; a bad value exits naming it."""

from __future__ import annotations

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
