"""Structured output (``SamplingParams.structured``): the tokenizer's vocabulary as raw bytes, the
grammar mask before every other processor, outputs of the default model (random weights) that
match their JSON schema / JSON object / choice / regex and end with "stop", and bits independent
of co-running requests."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from corun.default_model import EOS_TOKEN_IDS, SPECIAL_TOKENS, VOCAB_SIZE, bytes_to_unicode
from corun.grammar import GrammarCompiler, token_bytes
from corun.llm import LLM
from corun.logits_processing import PenaltyPool, process_rows
from corun.sampling_params import SamplingParams
from corun.sequence import Sequence
from corun.structured_output import StructuredOutput, json_object_regex
from corun.tokenizer import Tokenizer, tokenizer_for_model
from tests.engine.conftest import TINY

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
PROMPT = "Answer in JSON: "
# Random weights write long JSON strings; these biases close strings and objects sooner (they act
# after the mask, so they can only choose among the tokens the grammar allows).
SHORT_JSON_BIAS = {ord('"'): 6.0, ord("}"): 3.0}


def _assert_matches_schema(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"a", "b"}, text
    assert isinstance(value["a"], int) and not isinstance(value["a"], bool), text
    assert isinstance(value["b"], str) and len(value["b"]) <= 8, text


@pytest.fixture(scope="module")
def llm():
    with LLM(**{**TINY, "model": "corun-default", "max_model_len": 256}) as llm:
        yield llm


def _generate(llm: LLM, params: SamplingParams, prompt: str = PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


# -- the vocabulary ----------------------------------------------------------------------------


def test_default_tokenizer_vocabulary_is_the_bytes():
    """Each of the default tokenizer's byte tokens maps to its byte; specials and EOS are out;
    the tokens of an encoded text concatenate to the text's UTF-8 bytes."""
    tokenizer, _ = tokenizer_for_model("corun-default")
    table = token_bytes(tokenizer, VOCAB_SIZE, frozenset(EOS_TOKEN_IDS))
    assert table == {i: bytes([i]) for i in range(256)}
    assert not set(table) & set(SPECIAL_TOKENS.values())
    text = '{"ключ": "値 ✓", "n": -1.5e3}\n'
    ids = tokenizer.encode(text)
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")


def test_byte_level_merges_and_sentencepiece_tokens_map_to_their_bytes():
    symbol = bytes_to_unicode()
    byte_vocab = {symbol[b]: b for b in range(256)}
    merged = {**byte_vocab, "Ġt": 256, "Ġth": 257, "Ġthe": 258, "<|end|>": 259}
    hf = HFTokenizer(models.BPE(vocab=merged, merges=[("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|end|>"])
    table = token_bytes(Tokenizer(hf), 260, frozenset())
    assert table[258] == b" the" and table[ord("\n")] == b"\n" and 259 not in table
    ids = Tokenizer(hf).encode(" the é\n")
    assert 258 in ids and b"".join(table[i] for i in ids) == " the é\n".encode()
    spm = HFTokenizer(models.BPE(vocab={"<unk>": 0, "<0x0A>": 1, "▁the": 2, "é": 3, "a": 4},
                                 merges=[], unk_token="<unk>", byte_fallback=True))
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    spm.add_special_tokens(["<unk>"])
    assert token_bytes(Tokenizer(spm), 5, frozenset({4})) == {1: b"\n", 2: b" the",
                                                              3: "é".encode()}


def test_a_tokenizer_of_another_kind_is_refused():
    wordpiece = HFTokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="neither byte-level nor SentencePiece"):
        token_bytes(Tokenizer(wordpiece), 2, frozenset())


# -- the specs -----------------------------------------------------------------------------------


def test_specs_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="^guided_json: unsupported or invalid JSON schema"):
        StructuredOutput.from_schema({"type": "no-such-type"}, field="guided_json")
    with pytest.raises(ValueError, match="^structured: the schema is not valid JSON"):
        StructuredOutput.from_schema("{not json")
    with pytest.raises(ValueError, match="^structured: kind must be one of"):
        StructuredOutput("grammar", "x")
    with pytest.raises(ValueError, match="^structured: expected a non-empty tuple"):
        StructuredOutput("choice", ())
    with pytest.raises(ValueError, match="^ignore_eos: not supported with structured output"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))
    with pytest.raises(ValueError, match="^min_tokens: not supported with structured output"):
        SamplingParams(min_tokens=2, structured=StructuredOutput("json_object"))
    with pytest.raises(ValueError, match="^structured: expected a StructuredOutput"):
        SamplingParams(structured={"type": "json_object"})
    assert SamplingParams(structured=StructuredOutput("json_object")).has_logits_processing


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 0}, "'minimum' is not supported"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "'uniqueItems' is not supported"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 5}}},
     r"\.properties\.n: the JSON-schema keyword 'multipleOf'"),
    ({"type": "object", "required": ["x"]}, r"required \['x'\] not in 'properties'"),
    ({"type": "string", "pattern": "^a.*$"}, "pattern '\\^a\\.\\*\\$' is not supported"),
    ({"type": "string", "pattern": "[^0-9]+"}, "pattern .* is not supported"),
    ({"type": "string", "pattern": "[ -~]+"}, "pattern .* is not supported"),
    ({"type": "string", "format": "uri"}, "format 'uri' is not supported"),
    ({"anyOf": [{"type": "string", "format": "time"}]}, r"anyOf\[0\]: format 'time'"),
    ({"enum": ["a", "b"], "const": "a"}, "'const' with 'enum' is not supported"),
])
def test_schema_keywords_the_grammar_would_not_enforce_are_refused(schema, message):
    """outlines-core compiles these and ignores them (minimum 0 allowed -3), or lets a quote or
    a backslash into a string (a '.' pattern allowed {"x": "a"b"}): a ValueError naming the
    field and the keyword's path, never output that breaks the schema or is not JSON."""
    with pytest.raises(ValueError, match=f"^guided_json.*{message}"):
        StructuredOutput.from_schema(schema, field="guided_json")


def test_safe_patterns_and_a_property_named_like_a_keyword_are_served():
    for pattern in (r"^\d+\.\d+$", "[A-Za-z0-9_-]+", r"^[0-9]{3}-[0-9]{4}$", r"\w+"):
        StructuredOutput.from_schema({"type": "string", "pattern": pattern})
    StructuredOutput.from_schema({"type": "object", "properties": {
        "minimum": {"type": "integer"}}, "required": ["minimum"]})


def test_guided_regex_anchors_are_dropped_and_an_empty_match_is_refused():
    assert StructuredOutput("regex", "^[0-9]+$").regex == "[0-9]+"
    assert StructuredOutput("regex", r"ab\$").regex == r"ab\$"  # an escaped dollar stays
    for empty in ("[0-9]*", "a?", "x|"):
        with pytest.raises(ValueError, match="^guided_regex: a regex that matches the empty"):
            StructuredOutput("regex", empty, field="guided_regex")


def test_choices_are_literals():
    """Regex metacharacters and control characters in a choice match themselves."""
    tokenizer, _ = tokenizer_for_model("corun-default")
    compiler = GrammarCompiler(tokenizer, frozenset(EOS_TOKEN_IDS), VOCAB_SIZE)
    choice = "a.*(b]|#\n"
    guide = compiler.guide(StructuredOutput.from_choices([choice, "a"]))
    for byte in choice.encode():
        assert guide.allowed_mask(VOCAB_SIZE)[byte], byte
        guide.advance(byte)
    assert guide.allowed_mask(VOCAB_SIZE).nonzero().view(-1).tolist() == list(EOS_TOKEN_IDS)
    two_deep = '{"k": [1, "x", true], "o": {"x": null, "y": -2.5e+3}, "s": "\\n é"}'
    assert re.fullmatch(json_object_regex(), two_deep)
    assert not re.fullmatch(json_object_regex(), '{"k": [{"x": 1}]}')  # three deep


def test_a_disallowed_token_leaves_only_eos():
    """The guard behind the mask: a token the grammar rejects ends the match instead of
    failing the step; EOS ids beyond the model's vocabulary are ignored."""
    tokenizer, _ = tokenizer_for_model("corun-default")
    compiler = GrammarCompiler(tokenizer, frozenset({*EOS_TOKEN_IDS, 10**6}), VOCAB_SIZE)
    assert compiler.eos_token_ids == EOS_TOKEN_IDS
    guide = compiler.guide(StructuredOutput("regex", "[0-9]+"))
    guide.advance(ord("x"))
    assert guide.is_dead
    assert guide.allowed_mask(VOCAB_SIZE).nonzero().view(-1).tolist() == list(EOS_TOKEN_IDS)


def test_the_mask_comes_before_every_other_processor():
    """A masked token stays masked whatever its bias; the allowed ones get their bias."""
    tokenizer, _ = tokenizer_for_model("corun-default")
    compiler = GrammarCompiler(tokenizer, frozenset(EOS_TOKEN_IDS), VOCAB_SIZE)
    structured = StructuredOutput.from_choices(["ab", "c"])
    params = SamplingParams(structured=structured, logit_bias={ord("z"): 100.0, ord("c"): 2.0})
    seq = Sequence(0, "r", 0, [1, 2], params, seed=0)
    seq.guide = compiler.guide(structured)
    out = process_rows(torch.zeros(1, VOCAB_SIZE), [seq], PenaltyPool("cpu"))[0]
    finite = torch.isfinite(out).nonzero().view(-1).tolist()
    assert finite == [ord("a"), ord("c")]
    assert out[ord("c")].item() == 2.0 and out[ord("z")].item() == -math.inf


# -- through the engine ----------------------------------------------------------------------------


def test_json_schema_outputs_validate(llm):
    structured = StructuredOutput.from_schema(SCHEMA)
    for seed in range(4):
        (out,) = _generate(llm, SamplingParams(seed=seed, max_tokens=120, structured=structured))
        assert out.finish_reason == "stop", out.text
        _assert_matches_schema(out.text)


def test_json_object_outputs_are_objects(llm):
    structured = StructuredOutput("json_object")
    for seed in range(3):
        (out,) = _generate(llm, SamplingParams(seed=seed, max_tokens=150, structured=structured,
                                               logit_bias=SHORT_JSON_BIAS))
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict), out.text


def test_choice_and_regex_outputs_match(llm):
    choices = ["red", "green", "blue"]
    outs = _generate(llm, SamplingParams(n=6, seed=3, max_tokens=10,
                                         structured=StructuredOutput.from_choices(choices)))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 1  # each sample walks the grammar on its own
    (greedy,) = _generate(llm, SamplingParams(temperature=0, max_tokens=10,
                                              structured=StructuredOutput.from_choices(choices)))
    assert greedy.text in choices and greedy.finish_reason == "stop"
    pattern = "[0-9]{3}-[a-z]{2}"
    outs = _generate(llm, SamplingParams(n=2, best_of=3, seed=4, max_tokens=12,
                                         structured=StructuredOutput("regex", pattern)))
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs)


def test_max_tokens_cuts_a_match_short(llm):
    (out,) = _generate(llm, SamplingParams(seed=0, max_tokens=3,
                                           structured=StructuredOutput.from_schema(SCHEMA)))
    assert out.finish_reason == "length" and out.text.startswith("{")


def test_structured_requests_do_not_depend_on_co_runners(llm):
    """Mode corun: a structured request alone and batched with plain and structured requests
    samples the same tokens (fingerprints included)."""
    target = SamplingParams(seed=9, max_tokens=80, structured=StructuredOutput.from_schema(SCHEMA))
    alone = _generate(llm, target)[0]
    prompts = ["plain one", PROMPT, "x", "choose: ", PROMPT]
    params = [SamplingParams(seed=1, max_tokens=30),
              SamplingParams(seed=2, max_tokens=60, structured=StructuredOutput("json_object"),
                             logit_bias=SHORT_JSON_BIAS),
              SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.0),
              SamplingParams(seed=3, n=2, max_tokens=8,
                             structured=StructuredOutput.from_choices(["yes", "no"])),
              target]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert llm.config.mode == "corun"
    assert mixed[-1].outputs[0].token_ids == alone.token_ids
    assert mixed[-1].outputs[0].fingerprint == alone.fingerprint
    _assert_matches_schema(alone.text)


def test_engine_refusals_name_the_field(llm):
    engine = llm.engine
    bad_regex = StructuredOutput("regex", "(", field="guided_regex")
    with pytest.raises(ValueError, match="^guided_regex: cannot compile to a token grammar"):
        engine.add_request([1, 2, 3], SamplingParams(structured=bad_regex))
    assert not engine.has_unfinished_requests()


def test_no_tokenizer_no_structured_output():
    with LLM(**{**TINY, "model": "corun-default"}, skip_tokenizer_init=True) as bare:
        with pytest.raises(ValueError, match="^structured: needs a tokenizer"):
            bare.generate([[1, 2, 3]], SamplingParams(structured=StructuredOutput("json_object")),
                          use_tqdm=False)
