"""``decode_split_size`` is validated where it is configured, not at the first decode launch: the
decode attention kernels tile a split in 16-, 32- or 64-token KV blocks, so it must be a positive
multiple of 16 (EngineConfig and the models' OpsConfig alike). ``decode_fused_combine``, the
other decode attention knob, must be a bool, and the server's flag sets it."""

from __future__ import annotations

import pytest

from corun.config import EngineConfig
from kernels.mode import Mode
from models.forward_batch import OpsConfig

BAD = [0, -16, 8, 15, 24, 100, 257, 16.0, "256", True]
GOOD = [16, 32, 48, 256, 1024]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_engine_config_rejects_decode_split_size(value):
    with pytest.raises(ValueError, match="decode_split_size: expected a positive multiple of 16"):
        EngineConfig(decode_split_size=value)


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_ops_config_rejects_decode_split_size(value):
    with pytest.raises(ValueError, match="decode_split_size: expected a positive multiple of 16"):
        OpsConfig(Mode.CORUN, backend="torch", decode_split_size=value)


@pytest.mark.parametrize("value", GOOD)
def test_multiples_of_16_are_accepted(value):
    assert EngineConfig(decode_split_size=value).decode_split_size == value
    assert OpsConfig(Mode.CORUN, decode_split_size=value).decode_split_size == value


@pytest.mark.parametrize("value", [1, "true", None], ids=repr)
def test_decode_fused_combine_must_be_a_bool(value):
    with pytest.raises(ValueError, match="decode_fused_combine: expected a bool"):
        EngineConfig(decode_fused_combine=value)
    with pytest.raises(TypeError, match="decode_fused_combine: expected a bool"):
        OpsConfig(Mode.CORUN, decode_fused_combine=value)


def test_decode_fused_combine_flag_reaches_the_engine_config():
    from corun.serve import build_parser, engine_config_kwargs

    assert not engine_config_kwargs(build_parser().parse_args([]))["decode_fused_combine"]
    on = engine_config_kwargs(build_parser().parse_args(["--decode-fused-combine"]))
    assert on["decode_fused_combine"] is True and EngineConfig(**on).decode_fused_combine
