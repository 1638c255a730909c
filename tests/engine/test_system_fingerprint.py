"""The system fingerprint changes with everything that decides the bits and with nothing else;
LLM and the server share one CPU dtype default, so the same request has one fingerprint."""

from __future__ import annotations

import dataclasses

import pytest

from corun.config import EngineConfig
from corun.serve import build_parser, engine_config_kwargs
from corun.system_fingerprint import describe, system_fingerprint

BASE = EngineConfig(model="tiny-qwen3", device="cpu", max_num_seqs=8, max_model_len=128)


@pytest.mark.parametrize("change", [
    dict(num_kv_blocks=200), dict(max_queue_len=3), dict(prefill_token_budget=64),
    dict(cuda_graphs=False), dict(gpu_memory_utilization=0.5), dict(overlap_prefill_decode=True),
    dict(decode_fused_combine=True),  # the same bits (invariance_tests/test_engine_triton.py)
])
def test_sizing_and_pacing_knobs_keep_the_fingerprint(change):
    assert system_fingerprint(dataclasses.replace(BASE, **change)) == system_fingerprint(BASE)


@pytest.mark.parametrize("change", [
    dict(dtype="bfloat16"), dict(mode="batch_invariant"), dict(decode_batch_size=4),
    dict(decode_split_size=128), dict(prefill_policy="isolated"), dict(prefill_chunk_size=128),
    dict(seed=1), dict(model="tiny-qwen3-moe"), dict(max_model_len=256), dict(block_size=32),
    dict(prefill_step_tokens=4096), dict(max_prefill_seqs_per_step=16),
])
def test_every_bit_deciding_field_changes_the_fingerprint(change):
    assert system_fingerprint(dataclasses.replace(BASE, **change)) != system_fingerprint(BASE)


def test_dynamic_step_buckets_change_only_defaults_fingerprint():
    """default runs its kernels at the padded shapes, the batch-invariant peers keep their bits
    under the padding, and corun has no dynamic steps."""
    def changes(mode: str) -> bool:
        base = dataclasses.replace(BASE, mode=mode, max_num_batched_tokens=64)
        padded = dataclasses.replace(base, dynamic_graph_tokens=(32, 64))
        return system_fingerprint(padded) != system_fingerprint(base)

    assert changes("default")
    assert not any(changes(m) for m in ("batch_invariant", "batch_invariant_tuned", "corun"))


def test_defaults_fingerprint_follows_the_buckets_the_runner_pads_to(monkeypatch):
    """The runner knows the model: an MLA model captures no prefill graphs, so with the buckets
    left to None it pads nothing even where the config alone would list them; the engine's
    fingerprint is built from the runner's buckets. On a CUDA config, turning graphs off drops
    default's buckets (and changes its fingerprint) and leaves the batch-invariant modes'."""
    import corun.system_fingerprint as fingerprint_module
    from corun.engine import LLMEngine

    monkeypatch.setattr(fingerprint_module, "_device", lambda config: "a GPU")
    monkeypatch.setattr(fingerprint_module, "_card", lambda config: "h200")
    mla = dataclasses.replace(BASE, mode="default", model="tiny-deepseek-v3",
                              max_num_batched_tokens=256)
    gpu = dataclasses.replace(mla, device="cuda")
    assert gpu.dynamic_step_tokens == [128, 256]  # the config's view: graphs on, CUDA
    padded = dataclasses.replace(gpu, dynamic_graph_tokens=(128, 256))
    assert system_fingerprint(gpu, (), []) != system_fingerprint(padded, (), [128, 256])
    for mode, changes in (("default", True), ("batch_invariant", False),
                          ("batch_invariant_tuned", False)):
        on = dataclasses.replace(BASE, mode=mode, device="cuda", max_num_batched_tokens=256)
        off = dataclasses.replace(on, cuda_graphs=False)
        assert (system_fingerprint(on) != system_fingerprint(off)) is changes, mode
    explicit = dataclasses.replace(mla, dynamic_graph_tokens=(128, 256))  # on the CPU: padded
    for config, tokens in ((mla, []), (explicit, [128, 256])):
        engine = LLMEngine(config)
        assert engine.runner.dynamic_step_tokens == tokens
        assert engine.system_fingerprint == system_fingerprint(
            config, engine.eos_token_ids, tokens, engine.runner.weights_digest())


def test_llm_and_server_share_the_cpu_dtype_default():
    args = build_parser().parse_args(["--device", "cpu", "--model", "tiny-qwen3"])
    served = EngineConfig(**engine_config_kwargs(args))
    offline = EngineConfig(model="tiny-qwen3", device="cpu")  # what LLM("tiny-qwen3") builds
    assert served.torch_dtype == offline.torch_dtype
    assert describe(served)["dtype"] == "float32"
    for field in ("device", "torch", "triton", "outlines-core", "tuned_tables", "weights",
                  "sources"):
        assert field in describe(served)


def test_eos_ids_are_part_of_the_fingerprint():
    assert system_fingerprint(BASE, frozenset({1})) != system_fingerprint(BASE, frozenset({2}))


def test_llm_and_server_engines_of_one_config_share_the_fingerprint():
    from corun.engine import LLMEngine
    from corun.llm import LLM
    from corun.serve import load_tokenizer

    args = build_parser().parse_args(["--device", "cpu", "--max-model-len", "64",
                                      "--max-num-seqs", "2", "--prefill-chunk-size", "16"])
    kwargs = engine_config_kwargs(args)
    served = LLMEngine(EngineConfig(**kwargs), load_tokenizer(kwargs["model"]))
    with LLM(**kwargs) as llm:
        assert llm.system_fingerprint == served.system_fingerprint
    served.close()


def test_a_change_of_the_bit_deciding_sources_changes_their_digest(tmp_path):
    """A kernel whose order of addition changes at one version number must change the id."""
    from corun.system_fingerprint import source_digest

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "op.py").write_text("acc = a + b + c\n")
    before = source_digest((kernels,))
    assert source_digest((kernels,)) == before  # the same sources, the same digest
    (kernels / "op.py").write_text("acc = a + (b + c)\n")
    assert source_digest((kernels,)) != before
    assert len(source_digest()) == 16


def test_the_fingerprint_reads_the_tuned_tables_of_the_devices_card(tmp_path, monkeypatch):
    """Each card reads its own GEMM table over the H200's (kernels.gemm.table_files) and every
    card the MoE and MLA tables: another card's GEMM table leaves the fingerprint as it was, and
    a table the card reads changes it."""
    import shutil

    import corun.system_fingerprint as fingerprint_module
    from corun.system_fingerprint import tuned_table_files
    from kernels.gemm_tuned import TUNED_DIR

    names = lambda card: [p.name for p in tuned_table_files(card)]  # noqa: E731
    assert names("h100") == ["gemm_h100.json", "gemm_h200.json", "mla_h200.json", "moe_h200.json"]
    for card in ("h200", None, "some-other-gpu"):
        assert names(card) == ["gemm_h200.json", "mla_h200.json", "moe_h200.json"], card

    tuned = tmp_path / "tuned"
    shutil.copytree(TUNED_DIR, tuned)
    monkeypatch.setattr(fingerprint_module, "_TUNED_DIR", tuned)
    before = system_fingerprint(BASE)  # the CPU interpreter reads the H200's GEMM table
    (tuned / "gemm_h100.json").write_text((tuned / "gemm_h100.json").read_text() + "\n")
    assert system_fingerprint(BASE) == before
    (tuned / "moe_h200.json").write_text((tuned / "moe_h200.json").read_text() + "\n")
    assert system_fingerprint(BASE) != before
