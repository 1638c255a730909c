"""The offline API and the step-level engine on the CPU: outputs, seeds, n > 1, stop conditions,
abort, logprobs, chat, and bad input that raises a ValueError naming the field and disturbs
nothing in flight."""

from __future__ import annotations

import math

import pytest

from corun import LLM, SamplingParams
from corun.config import EngineConfig
from corun.engine import LLMEngine
from tests.engine.conftest import TINY


class IdTokenizer:
    """Decodes token t as "<t>" so a test can name the stop string of a known token. ``eos``:
    every EOS id; ``eos_token_id``: the tokenizer's own one among them."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, eos: tuple[int, ...] = (), eos_token_id: int | None = None,
                 has_generation_config: bool = False) -> None:
        self.eos_token_ids = eos
        self.eos_token_id = eos_token_id
        self.has_generation_config = has_generation_config

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(mode="corun", skip_tokenizer_init=True, **TINY)


def _drain(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_generate_outputs_in_input_order_with_seed_and_fingerprint(llm):
    prompts = [[3, 4, 5], {"prompt_token_ids": [9] * 11}, [7]]
    params = [SamplingParams(max_tokens=4, seed=11), SamplingParams(max_tokens=2, temperature=0),
              SamplingParams(max_tokens=3, ignore_eos=True)]  # unseeded: EOS must not end it
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[3, 4, 5], [9] * 11, [7]]
    assert [len(o.token_ids) for o in outs] == [4, 2, 3]
    assert all(o.finish_reason == "length" and len(o.fingerprint) == 64 for o in outs)
    assert outs[0].seed == 11 and 0 <= outs[2].seed < 2**64
    again = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, seed=11), use_tqdm=False)[0]
    assert again.token_ids == outs[0].token_ids and again.fingerprint == outs[0].fingerprint
    # An unseeded request draws its own seed; replaying it with that seed gives the same bits.
    replay = llm.generate([[7]], SamplingParams(max_tokens=3, seed=outs[2].seed, ignore_eos=True),
                          use_tqdm=False)[0]
    assert replay.fingerprint == outs[2].fingerprint


def test_n_samples_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, max_tokens=4, seed=5, temperature=1.0)
    out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    tokens = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(t) for t in tokens}) == 3, "samples keyed on seed and position alone"
    again = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert [c.fingerprint for c in again.outputs] == [c.fingerprint for c in out.outputs]


def test_stop_token_ids_eos_and_ignore_eos():
    engine = LLMEngine(EngineConfig(mode="corun", **TINY))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0), "free")
    free = _drain(engine)["free"].token_ids
    stop_id = free[2]
    first = free.index(stop_id)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                 stop_token_ids=[stop_id]), "stop")
    out = _drain(engine)["stop"]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free[: first + 1]
    # The same token as the tokenizer's EOS stops too, unless ignore_eos.
    eos_engine = LLMEngine(EngineConfig(mode="corun", **TINY),
                           tokenizer=IdTokenizer((stop_id,), eos_token_id=stop_id))
    eos_engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0), "eos")
    eos_engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True), "ignore")
    finals = _drain(eos_engine)
    assert finals["eos"].token_ids == free[: first + 1] and finals["eos"].stop_reason is None
    assert finals["ignore"].token_ids == free and finals["ignore"].finish_reason == "length"


def test_an_eos_id_other_than_the_tokenizers_own_stops_with_its_id():
    """vLLM: an EOS id other than the tokenizer's own (generation_config.json's) is a stop id:
    finish_reason "stop", stop_reason the id; the tokenizer's own EOS gives stop_reason None.
    ignore_eos goes past both, and min_tokens masks both, with ignore_eos too."""
    config = EngineConfig(mode="corun", **TINY)
    engine = LLMEngine(config)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0), "free")
    free = _drain(engine)["free"].token_ids
    eos = free[2]
    unused = next(t for t in range(256) if t not in free)  # an own EOS never generated
    finals = {}
    for own in (eos, unused):  # the same EOS id as the tokenizer's own, then as an extra one
        engine = LLMEngine(config, tokenizer=IdTokenizer((own, eos), eos_token_id=own))
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0), "eos")
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True), "ignore")
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True, min_tokens=3), "min")
        finals[own] = _drain(engine)
    first = free.index(eos)
    for own, stop_reason in ((eos, None), (unused, eos)):
        out = finals[own]
        assert out["eos"].token_ids == free[: first + 1] and out["eos"].finish_reason == "stop"
        assert out["eos"].stop_reason == stop_reason
        assert out["ignore"].token_ids == free and out["ignore"].stop_reason is None
        assert eos not in out["min"].token_ids[:3] and len(out["min"].token_ids) == 8


def test_the_model_configs_eos_stops_only_without_a_generation_config():
    """vLLM builds its generation config from config.json only when the checkpoint has no
    generation_config.json: tiny-qwen3's config EOS (1) stops a sample then, not otherwise."""
    config = EngineConfig(mode="corun", **TINY)
    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={1: 100.0})
    outs = {}
    for found in (False, True):
        engine = LLMEngine(config, tokenizer=IdTokenizer((7,), 7, has_generation_config=found))
        engine.add_request([5, 6], params, "r")
        outs[found] = _drain(engine)["r"].outputs[0]
    assert (outs[False].token_ids, outs[False].finish_reason) == ([1], "stop")
    assert (outs[True].token_ids, outs[True].finish_reason) == ([1] * 4, "length")


def test_stop_string_cuts_text_and_max_model_len_stops():
    engine = LLMEngine(EngineConfig(mode="corun", **TINY), tokenizer=IdTokenizer())
    engine.add_request([8, 9], SamplingParams(max_tokens=6, temperature=0), "free")
    free = _drain(engine)["free"]
    stop = f"<{free.token_ids[3]}>"
    engine.add_request([8, 9], SamplingParams(max_tokens=6, temperature=0, stop=[stop]), "s")
    out = _drain(engine)["s"]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    engine.add_request([8] * 61, SamplingParams(max_tokens=10, temperature=0), "long")
    long = _drain(engine)["long"]
    assert long.finish_reason == "length" and len(long.token_ids) == 64 - 61


def test_abort_frees_blocks_and_the_other_request_finishes():
    engine = LLMEngine(EngineConfig(mode="corun", **TINY))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, seed=1), "a")
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=5, seed=2), "b")
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    finals = _drain(engine)
    assert finals["a"].finish_reason == "abort" and finals["b"].finish_reason == "length"
    assert engine.stats()["num_kv_blocks_used"] == 0 and not engine.requests


def test_an_aborted_best_of_request_reports_its_first_samples():
    """Partial samples do not rank: a sample that never ran (its logprobs sum to 0) would
    otherwise come first."""
    engine = LLMEngine(EngineConfig(mode="corun", **dict(TINY, max_num_seqs=2)))
    engine.add_request([1, 2, 3], SamplingParams(n=1, best_of=4, max_tokens=20, seed=1), "a")
    for _ in range(3):
        engine.step()
    assert any(not s.logprobs for s in engine.requests["a"].seqs)  # some never ran
    engine.abort_request("a")
    final = _drain(engine)["a"]
    assert final.finish_reason == "abort" and final.outputs[0].token_ids


def test_deltas_add_up_and_logprobs_are_log_probabilities():
    engine = LLMEngine(EngineConfig(mode="corun", **TINY))
    engine.add_request([2, 3], SamplingParams(max_tokens=5, seed=3, logprobs=0), "r")
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.extend(out.delta_token_ids)
            final = out
    assert deltas == final.token_ids and len(final.logprobs) == 5
    assert all(math.isfinite(x) and x <= 0 for x in final.logprobs)


def test_a_final_only_request_reports_once_what_a_cumulative_one_reports_last():
    """``final_only`` (LLM.generate's, vLLM's FINAL_ONLY): one output, at the finish, equal to
    the last output of the same request reported every step; aborted ones report too."""
    from corun.tokenizer import tokenizer_for_model

    tokenizer, _ = tokenizer_for_model("corun-default")
    engine = LLMEngine(EngineConfig(mode="corun", **dict(TINY, model="corun-default")), tokenizer)
    params = SamplingParams(max_tokens=9, seed=4, stop=["zz"], logprobs=1)
    engine.add_request([5, 6, 7], params, "every", final_only=False)
    engine.add_request([5, 6, 7], params, "final", final_only=True)
    engine.add_request([8, 9], SamplingParams(max_tokens=30, seed=5), "aborted", final_only=True)
    seen: dict[str, list] = {"every": [], "final": [], "aborted": []}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        steps += 1
        if steps == 3:
            engine.abort_request("aborted")
    assert len(seen["every"]) > 1 and len(seen["final"]) == 1 and len(seen["aborted"]) == 1
    every, final = seen["every"][-1].outputs[0], seen["final"][0].outputs[0]
    assert seen["final"][0].finished and seen["aborted"][0].outputs[0].finish_reason == "abort"
    assert (final.token_ids, final.text, final.fingerprint, final.logprobs) == (
        every.token_ids, every.text, every.fingerprint, every.logprobs)
    assert final.delta_token_ids == final.token_ids and final.delta_text == final.text


def test_a_final_only_request_ends_with_the_streamed_text_under_byte_fallback():
    """Llama's byte-fallback decoder turns an invalid UTF-8 run (<0x00><0x80>) into U+FFFD
    whole, where the text that followed the steps keeps the settled NUL (corun.detokenizer): a
    final-only request still follows the steps, so LLM.generate and a stream end alike."""
    from corun.tokenizer import Tokenizer
    from tests.engine.test_detokenizer import sentencepiece_like

    tokenizer = Tokenizer(sentencepiece_like(True))
    engine = LLMEngine(EngineConfig(mode="corun", **dict(TINY, model="corun-default")), tokenizer)
    # The bias forces token 1 (<0x00>) then 129 (<0x80>): the penalty halves 1's after it.
    params = SamplingParams(temperature=0, max_tokens=2, logit_bias={1: 100.0, 129: 80.0},
                            repetition_penalty=2.0)
    engine.add_request([5, 6, 7], params, "every", final_only=False)
    engine.add_request([5, 6, 7], params, "final", final_only=True)
    finals = _drain(engine)
    every, final = finals["every"].outputs[0], finals["final"].outputs[0]
    assert every.token_ids == final.token_ids == [1, 129]
    assert tokenizer.decode([1, 129]) == "\ufffd\ufffd"  # the whole decode differs
    assert final.text == every.text == "\x00\ufffd"


def test_chat_applies_the_template():
    llm = LLM("corun-default", mode="corun", device="cpu", dtype="float32", max_num_seqs=2,
              max_model_len=128, prefill_chunk_size=16, block_size=16)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, seed=0),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == 257 and out.prompt_token_ids[-2:] == [116, 10]
    assert isinstance(out.text, str) and len(out.token_ids) <= 2


@pytest.mark.parametrize(
    "prompt, params, field",
    [([], None, "prompt"), ([1] * 64, None, "prompt"), ([1, 999], None, "prompt_token_ids"),
     ("text", None, "prompt"), ([1], ["greedy"], "params"),
     ([1], [SamplingParams(stop="x")], "stop")],
    ids=["empty", "too-long", "out-of-vocab", "text-without-tokenizer", "bad-params",
         "stop-string-without-tokenizer"],
)
def test_bad_input_raises_and_leaves_inflight_untouched(llm, prompt, params, field):
    victim = SamplingParams(max_tokens=5, seed=9)
    llm.engine.add_request([1, 2, 3, 4, 5], victim, "victim")
    llm.engine.step()
    llm.engine.step()
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([prompt], params, use_tqdm=False)
    disturbed = _drain(llm.engine)["victim"]
    # corun: the request alone gives the same bits as the one that lived through the bad call.
    alone = llm.generate([[1, 2, 3, 4, 5]], victim, use_tqdm=False)[0]
    assert disturbed.fingerprint == alone.fingerprint and len(disturbed.token_ids) == 5


def test_generate_validates_every_prompt_before_queueing(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="^params:"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)


def test_max_model_len_past_the_model_positions_is_refused_before_building():
    """The tiny models serve 4096 positions: a longer max_model_len is a ValueError at once (a
    prompt past the RoPE table crashed a step, and every step after it, before)."""
    with pytest.raises(ValueError, match="^max_model_len: 8192 exceeds the 4096 positions"):
        LLM(model="tiny-qwen3", max_model_len=8192, skip_tokenizer_init=True)
    llm = LLM(model="tiny-qwen3", max_model_len=1024, skip_tokenizer_init=True,
              prefill_chunk_size=256)
    out = llm.generate([[3] * 700], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_generate_without_params_takes_the_generation_config(tmp_path):
    """vLLM's LLM(generation_config=...): generate() without params samples with the model's
    generation_config.json defaults; "vllm" ignores them."""
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.0, "max_new_tokens": 3, "do_sample": false}')
    with LLM(model="tiny-qwen3", generation_config=str(tmp_path), skip_tokenizer_init=True,
             **{k: v for k, v in TINY.items() if k != "model"}) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
        out = llm.generate([[5, 6, 7]], use_tqdm=False)[0]
        greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3),
                              use_tqdm=False)[0]
        assert out.token_ids == greedy.token_ids
    with LLM(model="tiny-qwen3", generation_config="vllm", skip_tokenizer_init=True,
             **{k: v for k, v in TINY.items() if k != "model"}) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="^generation_config: "):
        LLM(model="tiny-qwen3", generation_config=str(tmp_path / "none"))


def test_more_samples_than_the_queue_holds_is_a_value_error():
    engine = LLMEngine(EngineConfig(mode="corun", **dict(TINY, max_queue_len=2)))
    with pytest.raises(ValueError, match="^n: 3 sequences .* exceed max_queue_len 2"):
        engine.add_request([1, 2], SamplingParams(n=3, max_tokens=2), "a")
    assert not engine.requests


def test_a_max_model_len_below_the_chunk_size_serves_on_the_triton_kernels():
    """max_model_len 192 under the default prefill_chunk_size 256: a step shape's chunk bound
    exceeds every block table, and the Triton prefill sized its grid by it (it refused the
    launch); every config the engine accepts must serve."""
    with LLM(model="tiny-qwen3", backend="triton", max_model_len=192, max_num_seqs=2,
             prefill_step_tokens=256, prefill_token_budget=256,
             skip_tokenizer_init=True) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, seed=1),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
