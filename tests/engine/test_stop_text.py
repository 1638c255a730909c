"""Stop conditions and output text against vLLM's semantics, on the CPU with a tokenizer that
decodes chosen tokens to chosen text: a stop string must end in the text the newest token added
(and past the first ``min_tokens`` tokens' text), however long that token's text is; a stop id
or EOS ends the text before its own text unless ``include_stop_str_in_output``; step-level
``delta_text`` concatenates to the final text (held back while it may still change);
``logprobs=0`` gives one empty dict a step."""

from __future__ import annotations

import pytest

from corun import SamplingParams
from corun.config import EngineConfig
from corun.engine import LLMEngine
from tests.engine.conftest import TINY

PROMPT = [8, 9]
GREEDY = {"temperature": 0.0}


class MapTokenizer:
    """Token t decodes to ``texts[t]`` if given, else "<t>"; ``raw`` maps tokens to bytes
    instead, decoded as UTF-8 with replacement (a byte-level tokenizer)."""

    def __init__(self, texts: dict[int, str] | None = None, raw: dict[int, bytes] | None = None,
                 eos: tuple[int, ...] = ()) -> None:
        self.texts, self.raw, self.eos_token_ids = texts or {}, raw, eos

    def decode(self, ids, skip_special_tokens=True):
        if self.raw is not None:
            return b"".join(self.raw.get(t, b"?") for t in ids).decode("utf-8", errors="replace")
        return "".join(self.texts.get(t, f"<{t}>") for t in ids)


def _engine(tokenizer: MapTokenizer) -> LLMEngine:
    return LLMEngine(EngineConfig(mode="corun", **TINY), tokenizer=tokenizer)


def _steps(engine: LLMEngine, params: SamplingParams) -> list:
    """Every output of one request, step by step (the last is the finished one)."""
    engine.add_request(PROMPT, params, "r")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0] for o in engine.step()]
    return outputs


@pytest.fixture(scope="module")
def free() -> list[int]:
    """The greedy tokens of PROMPT (distinct ones, so a test can name a token by its place)."""
    tokens = _steps(_engine(MapTokenizer()), SamplingParams(max_tokens=8, **GREEDY))[-1].token_ids
    assert len(set(tokens[:6])) == 6, tokens
    return tokens


def test_stop_string_inside_a_long_token_is_found(free):
    tokenizer = MapTokenizer({free[2]: "STOP" + "=" * 30})  # longer than len(stop) + 16
    out = _steps(_engine(tokenizer), SamplingParams(max_tokens=8, stop=["STOP"], **GREEDY))[-1]
    assert (out.finish_reason, out.stop_reason) == ("stop", "STOP")
    assert out.token_ids == free[:3] and out.text == tokenizer.decode(free[:2])


def test_stop_string_within_min_tokens_does_not_stop(free):
    # "dd" is complete in the text of the first token; a stop needs text past min_tokens tokens.
    tokenizer = MapTokenizer({t: "d" for t in free})
    params = SamplingParams(max_tokens=6, min_tokens=3, stop=["dd"], **GREEDY)
    out = _steps(_engine(tokenizer), params)[-1]
    # The 4th token's "d" ends a new "dd" (its first "d" from the 3rd token): stop there.
    assert (out.finish_reason, out.stop_reason) == ("stop", "dd")
    assert out.token_ids == free[:4] and out.text == "dd"
    # Without the stop string in reach after min_tokens, the output runs to its length.
    tokenizer = MapTokenizer({free[0]: "dd"})
    out = _steps(_engine(tokenizer), SamplingParams(max_tokens=6, min_tokens=2, stop=["dd"],
                                                    **GREEDY))[-1]
    assert out.finish_reason == "length" and out.text == tokenizer.decode(free[:6])


@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stop_token_text_is_cut_unless_kept(free, how, include):
    stop_id = free[2]
    tokenizer = MapTokenizer(eos=(stop_id,) if how == "eos" else ())
    extra = {"stop_token_ids": [stop_id]} if how == "stop_token_ids" else {}
    params = SamplingParams(max_tokens=8, include_stop_str_in_output=include, **extra, **GREEDY)
    out = _steps(_engine(tokenizer), params)[-1]
    assert out.finish_reason == "stop" and out.token_ids == free[:3]
    assert out.text == tokenizer.decode(free[: 3 if include else 2])


def test_delta_text_adds_up_to_the_text_across_a_stop_and_a_split_character(free):
    # A stop string that begins in one token and ends in the next: the first token's "<" part
    # must not be handed out before the match cuts it.
    tokenizer = MapTokenizer({free[1]: "ab<", free[2]: "END>", free[3]: "x"})
    steps = _steps(_engine(tokenizer), SamplingParams(max_tokens=8, stop=["<END>"], **GREEDY))
    assert steps[-1].stop_reason == "<END>" and steps[-1].text.endswith("ab")
    assert "".join(o.delta_text for o in steps) == steps[-1].text
    assert all(steps[-1].text.startswith(o.text) for o in steps)
    # "é" is two bytes over two tokens: no U+FFFD reaches a delta.
    raw = {free[0]: b"A", free[1]: b"\xc3", free[2]: b"\xa9", free[3]: b"B"}
    steps = _steps(_engine(MapTokenizer(raw=raw)), SamplingParams(max_tokens=4, **GREEDY))
    assert steps[-1].text == "A\u00e9B"
    assert "".join(o.delta_text for o in steps) == "A\u00e9B"


def test_logprobs_zero_gives_an_empty_dict_a_step(free):
    out = _steps(_engine(MapTokenizer()), SamplingParams(max_tokens=4, logprobs=0, **GREEDY))[-1]
    assert len(out.logprobs) == 4 and out.top_logprobs == [{}] * 4


def test_a_stop_string_ending_in_an_incomplete_character_is_never_streamed(free):
    # "f€": "f" ends the first token, "€" takes the next two; while "€" is incomplete the "f"
    # must stay held back (the replacement character must not use up the hold-back).
    raw = {free[0]: b"abcdef", free[1]: b"\xe2\x82", free[2]: b"\xac", free[3]: b"z"}
    steps = _steps(_engine(MapTokenizer(raw=raw)),
                   SamplingParams(max_tokens=6, stop=["f\u20ac"], **GREEDY))
    assert steps[-1].stop_reason == "f\u20ac" and steps[-1].text == "abcde"
    assert "".join(o.delta_text for o in steps) == "abcde"


def test_a_stop_id_that_completes_a_character_takes_it_out_of_the_text(free):
    raw = {free[0]: b"A", free[1]: b"\xe2\x82", free[2]: b"\xacTAIL"}
    out = _steps(_engine(MapTokenizer(raw=raw)),
                 SamplingParams(max_tokens=6, stop_token_ids=[free[2]], **GREEDY))[-1]
    assert out.finish_reason == "stop" and out.token_ids == free[:3] and out.text == "A"


def test_the_first_stop_string_of_the_list_found_in_the_new_text_wins(free):
    """vLLM's check_stop_strings: the list's order, not the earliest match in the text."""
    tokenizer = MapTokenizer({free[0]: "x", free[1]: "abcd"})
    out = _steps(_engine(tokenizer),
                 SamplingParams(max_tokens=6, stop=["abcd", "bc"], **GREEDY))[-1]
    assert (out.stop_reason, out.text) == ("abcd", "x")
    out = _steps(_engine(tokenizer),
                 SamplingParams(max_tokens=6, stop=["bc", "abcd"], **GREEDY))[-1]
    assert (out.stop_reason, out.text) == ("bc", "xa")
