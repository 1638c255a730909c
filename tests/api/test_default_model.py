"""The embedded default model's tokenizer and the server's incremental text (no server needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from corun.api.streaming import ChoiceState
from corun.default_model import ASSETS_DIR, EOS_TOKEN_IDS, SPECIAL_TOKENS, asset_texts
from corun.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(ASSETS_DIR)


def test_shipped_assets_match_the_builder():
    for name, text in asset_texts().items():
        assert (ASSETS_DIR / name).read_text(encoding="utf-8") == text, (
            f"corun/assets/{name} is stale: run python -m corun.default_model"
        )


def test_bytes_are_their_own_ids_and_round_trip(tokenizer: Tokenizer):
    text = "Héllo, wörld 😀\n\ttabs & <tags>"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_specials_ids_eos_and_chat_template(tokenizer: Tokenizer):
    for text, token_id in SPECIAL_TOKENS.items():
        assert tokenizer.token_to_id(text) == token_id
    assert set(tokenizer.eos_token_ids) == set(EOS_TOKEN_IDS)
    assert tokenizer.eos_token_id == SPECIAL_TOKENS["<|im_end|>"]  # its own, tokenizer_config's
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]
    # Specials are skipped when decoding output text, kept on request.
    assert tokenizer.decode([257, 104, 105, 258]) == "hi"
    assert tokenizer.decode([257, 104, 258], skip_special_tokens=False) == "<|im_start|>h<|im_end|>"


def _stream(
    tokenizer: Tokenizer,
    ids: list[int],
    stop: tuple[str, ...] = (),
    finish: tuple[str, str | None] = ("length", None),
) -> tuple[list[str], str]:
    """Feed ids one per step into a ChoiceState; returns the deltas and the final text."""
    choice = ChoiceState(index=0, prompt_len=1, decode=tokenizer.decode, stop_strings=stop)
    deltas = []
    for end in range(1, len(ids) + 1):
        last = end == len(ids)
        output = SimpleNamespace(
            token_ids=ids[:end],
            logprobs=None,
            text=None,
            finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None,
            fingerprint="f" if last else None,
        )
        choice.update(output, seed=1)
        deltas.append(choice.take_delta()[0])
    return deltas, choice.text


def test_stream_deltas_never_split_a_character(tokenizer: Tokenizer):
    """Deltas concatenate to the final text, and no delta ends inside a multi-byte character."""
    text = "aé😀b"
    deltas, final = _stream(tokenizer, list(text.encode("utf-8")))
    assert "".join(deltas) == final == text
    assert all("\ufffd" not in d for d in deltas)
    # Negative control: decoding each prefix naively does show the partial characters.
    naive = [tokenizer.decode(list(text.encode("utf-8"))[:k]) for k in range(1, 8)]
    assert any(t.endswith("\ufffd") for t in naive)


def test_stream_holds_back_a_stop_string_prefix(tokenizer: Tokenizer):
    """Text that may start a stop string is held back; the stop string never reaches the client."""
    ids = list(b"hello END")
    deltas, final = _stream(tokenizer, ids, stop=("END",), finish=("stop", "END"))
    assert final == "hello "
    assert "".join(deltas) == "hello "
    assert not any("E" in d for d in deltas)


def test_long_texts_encode_to_the_same_ids(tokenizer: Tokenizer):
    """Texts from RELEASE_GIL_CHARS on take the GIL-releasing path: the same ids as the other."""
    from corun.tokenizer import RELEASE_GIL_CHARS

    text = ("Héllo <|im_start|> wörld 😀 " * RELEASE_GIL_CHARS)[:RELEASE_GIL_CHARS]
    assert tokenizer.encode(text) == tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


# Uses what transformers' template environment adds to Jinja's: its tojson (no HTML escaping, no
# key sorting, indent), loop controls, strftime_now and the generation block.
HF_ONLY_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{{ m['role'] }}:{% generation %}{{ m['content'] | tojson }}{% endgeneration %}|"
    "{{ m | tojson(indent=1) }}\n{% endfor %}"
    "{{ strftime_now('%Y') | length }}"
)


def test_chat_template_renders_as_transformers_renders_it(tokenizer: Tokenizer):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    messages = [{"role": "user", "content": "a<b> & 'c' \u00e9", "z": 1, "a": 2},
                {"role": "skip", "content": "x"}, {"role": "stop", "content": "y"},
                {"role": "user", "content": "never"}]
    ours = Tokenizer(tokenizer.tokenizer, chat_template=HF_ONLY_TEMPLATE)
    text = ours.apply_chat_template(messages, tokenize=False)
    hf = _compile_jinja_template(HF_ONLY_TEMPLATE).render(messages=messages,
                                                          add_generation_prompt=True,
                                                          bos_token="", eos_token="")
    assert text == hf
    assert '"a<b> & \'c\' \u00e9"' in text and '"z": 1,\n "a": 2' in text
    assert "never" not in text and "skip" not in text


def test_a_choice_reads_a_prefix_every_live_list_holds(tokenizer: Tokenizer):
    """The engine thread appends a token, then its logprob, then its top-N to the lists an
    output hands out, while the event loop reads them: caught between two appends, the choice
    takes the shortest prefix, so no token goes out without its logprobs."""
    choice = ChoiceState(index=0, prompt_len=1, decode=tokenizer.decode)
    mid_append = SimpleNamespace(token_ids=[72, 105, 33], logprobs=[-0.5, -0.25],
                                 top_logprobs=[{72: -0.5}], text=None, finish_reason=None,
                                 stop_reason=None, fingerprint=None)
    choice.update(mid_append, seed=1)
    text, ids, logprobs = choice.take_delta()
    assert ids == [72] and logprobs == [(-0.5, {72: -0.5})] and text == "H"
    mid_append.logprobs.append(-1.0)
    mid_append.top_logprobs += [{105: -0.25}, {33: -1.0}]
    choice.update(mid_append, seed=1)
    assert choice.take_delta()[1:] == ([105, 33], [(-0.25, {105: -0.25}), (-1.0, {33: -1.0})])


class _SliceRecorder(list):
    """A live list that records how many elements each slice of it copied."""

    def __init__(self, *args):
        super().__init__(*args)
        self.copied: list[int] = []

    def __getitem__(self, key):
        item = super().__getitem__(key)
        if isinstance(key, slice):
            self.copied.append(len(item))
        return item


def test_a_choice_copies_only_the_new_tokens_of_a_live_list(tokenizer: Tokenizer):
    """An update copies what the engine appended since the previous one, not the whole output
    again (one update a step would otherwise copy O(n) for each of n tokens); a different
    list (another sample's) starts the choice over from it."""
    choice = ChoiceState(index=0, prompt_len=1, decode=tokenizer.decode)
    live = SimpleNamespace(token_ids=_SliceRecorder(), logprobs=_SliceRecorder(), text=None,
                           finish_reason=None, stop_reason=None, fingerprint=None)
    for step in range(200):
        live.token_ids.append(65 + step % 26)
        live.logprobs.append(-float(step))
        choice.update(live, seed=1)
    assert choice.token_ids == list(live.token_ids) and choice.logprobs == list(live.logprobs)
    assert max(live.token_ids.copied + live.logprobs.copied) == 1
    other = SimpleNamespace(token_ids=[66, 67], logprobs=[-1.0, -2.0], text=None,
                            finish_reason=None, stop_reason=None, fingerprint=None)
    choice.update(other, seed=1)
    assert choice.token_ids == [66, 67] and choice.logprobs == [-1.0, -2.0]
