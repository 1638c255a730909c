"""SamplingParams and EngineConfig reject bad input with a ValueError naming the field."""

import pytest

from corun.config import EngineConfig
from corun.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
     ("top_p", 1.5), ("top_k", -2), ("max_tokens", -1), ("seed", -(2**63) - 1), ("seed", 2**64),
     ("seed", 1.5), ("stop", [""]), ("stop_token_ids", [-3]), ("logprobs", -1),
     ("prompt_logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
     ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0), ("logit_bias", {-1: 1.0}),
     ("logit_bias", {3: 101.0}), ("min_tokens", -1), ("min_tokens", 17), ("min_p", 1.5),
     ("best_of", 0), ("stop", 5), ("stop_token_ids", 5), ("ignore_eos", "no"),
     ("include_stop_str_in_output", 1), ("skip_special_tokens", None)],
    ids=lambda v: repr(v),
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_valid_edges_are_accepted():
    params = SamplingParams(temperature=0, top_p=1.0, top_k=-1, seed=2**64 - 1, stop="x",
                            stop_token_ids=[0], max_tokens=1)
    assert params.is_greedy and params.effective_top_k == 0
    assert params.stop_strings == ("x",) and params.stop_token_set == frozenset({0})
    assert SamplingParams(top_k=5).effective_top_k == 5


@pytest.mark.parametrize(
    "field, value",
    [("mode", "fast"), ("dtype", "int8"), ("backend", "cuda"), ("max_num_seqs", 0),
     ("block_size", 12), ("num_kv_blocks", 2), ("decode_batch_size", 0),
     ("gpu_memory_utilization", 0.0), ("decode_split_size", 8), ("max_num_batched_tokens", 4),
     ("seed", -5)],
)
def test_bad_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**{"max_model_len": 64, "max_num_seqs": 8, field: value})


def test_engine_config_derived_values():
    config = EngineConfig(mode="corun", device="cpu", max_num_seqs=6, decode_batch_size=4)
    assert config.decode_buckets == [4] and config.max_running_seqs == 6
    assert config.resolved_backend == "torch" and not config.use_cuda_graphs
    dynamic = EngineConfig(mode="default", device="cpu", max_num_seqs=8)
    assert dynamic.decode_buckets == [1, 2, 4, 8] and dynamic.max_running_seqs == 8
    assert str(EngineConfig(dtype="bf16").torch_dtype) == "torch.bfloat16"


@pytest.mark.parametrize("backend", ["triton", None], ids=["triton", "default-on-cuda"])
@pytest.mark.parametrize("field, value", [("prefill_chunk_size", 64),
                                          ("max_num_batched_tokens", 64)])
def test_batch_invariant_chunks_need_the_query_tile(backend, field, value):
    """A batch-invariant chunk cut short ends on the prefill kernel's query tile (128 rows in
    bf16): a chunk size off it, or a budget below it, would leave a long prompt unscheduled.
    The backend the config resolves to decides, so the default on CUDA (Triton) is checked."""
    config = {"mode": "batch_invariant", "device": "cuda", "dtype": "bfloat16", "backend": backend,
              "max_model_len": 1024, "max_num_seqs": 8, "prefill_chunk_size": 256, field: value}
    with pytest.raises(ValueError, match=f"^{field}: .*query tile"):
        EngineConfig(**config)
    assert EngineConfig(**{**config, "backend": "torch"}).prefill_alignment == 1


def test_max_model_len_defaults_to_what_the_model_serves(tmp_path):
    """2048 unless the model serves fewer positions (vLLM derives its default from the model
    too); an explicit value stays as given (the engine refuses one above the model's)."""
    import json

    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 32, "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert EngineConfig(model=str(tmp_path)).max_model_len == 1024
    assert EngineConfig(model=str(tmp_path), max_model_len=512).max_model_len == 512
    assert EngineConfig(model="qwen3-8b").max_model_len == 2048
    assert EngineConfig(model=str(tmp_path / "absent")).max_model_len == 2048
