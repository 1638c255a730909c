"""Incremental detokenization (corun.detokenizer) gives what a full decode gives, at every step:
byte-level BPE with tokens cut inside UTF-8 characters, SentencePiece-style Metaspace and
Llama's byte-fallback decoder chain, special tokens skipped or kept; and each step decodes a
window, not the whole output."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from corun.default_model import build_tokenizer, bytes_to_unicode
from corun.detokenizer import IncrementalText
from corun.outputs import REPLACEMENT_CHAR

# Text whose UTF-8 has 1-4 byte characters, so byte-level pieces end inside characters.
CORPUS = "the quick brown fox — naïve café 你好世界 データ 🙂🚀 ∑∫ Ωmega \n\t end"
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def _pieces(rng: random.Random, symbols: list[str], count: int) -> list[str]:
    """``count`` distinct substrings of ``symbols`` (1-6 symbols long), for a vocabulary."""
    pieces: set[str] = set()
    while len(pieces) < count:
        start = rng.randrange(len(symbols))
        pieces.add("".join(symbols[start:start + rng.randint(1, 6)]))
    return sorted(pieces)


def _with_specials(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIALS])
    return tokenizer


def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Qwen-style: the 256 byte symbols plus multi-byte pieces of the corpus."""
    byte_symbol = bytes_to_unicode()
    symbols = [byte_symbol[b] for b in CORPUS.encode()]
    vocab = {s: i for i, s in enumerate(byte_symbol.values())}
    for piece in _pieces(random.Random(0), symbols, 200):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    return _with_specials(tokenizer)


def sentencepiece_like(llama_chain: bool) -> Tokenizer:
    """Metaspace pieces (``▁`` for a space) with byte-fallback tokens ``<0xNN>``; the decoder is
    Llama's chain (replace, byte fallback, fuse, strip one leading space) or plain Metaspace."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    symbols = list(CORPUS.replace(" ", "\u2581"))
    for piece in ["\u2581", *_pieces(random.Random(1), symbols, 200)]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                     byte_fallback=True))
    if llama_chain:
        tokenizer.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])
    else:
        tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return _with_specials(tokenizer)


TOKENIZERS = {"default-model": build_tokenizer, "byte-level-bpe": byte_level_bpe,
              "llama-byte-fallback": lambda: sentencepiece_like(True),
              "metaspace": lambda: sentencepiece_like(False)}
BUILT = {name: build() for name, build in TOKENIZERS.items()}


def _check_every_step(tokenizer: Tokenizer, ids: list[int], chunks: list[int],
                      skip_special_tokens: bool,
                      whole: set[int] | None = None) -> IncrementalText:
    """Update one state step by step; each step's text must be the full decode. With
    ``whole`` (the prefix lengths that end on a whole character), a step that ends inside a
    character must show U+FFFD after at most the text up to the last whole one (a run of byte
    tokens that arrived in one step decodes, whole, to U+FFFD, as in the full decode)."""
    def decode(token_ids):
        return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    state, end = IncrementalText(), 0
    for chunk in chunks:
        end = min(end + chunk, len(ids))
        text = state.update(decode, ids[:end])
        if whole is None or end in whole:
            assert text == decode(ids[:end]), ids[:end]
        else:
            settled = decode(ids[:max(w for w in whole if w < end)])
            shown = text.rstrip(REPLACEMENT_CHAR)
            assert text.endswith(REPLACEMENT_CHAR) and settled.startswith(shown), ids[:end]
    return state


def _byte_fallback_ids(data, tokenizer: Tokenizer) -> tuple[list[int], set[int]]:
    """Ids whose byte-fallback tokens spell whole UTF-8 characters, and the prefix lengths that
    end on a whole one. A byte-fallback decoder turns a whole run of byte tokens into U+FFFD
    when the run is not valid UTF-8 (an incomplete last character included), so there a
    settled byte's text changes with later tokens (test_byte_fallback_invalid_run_differs):
    the full decode is the reference only where the run is complete."""
    pieces = [i for t, i in tokenizer.get_vocab(with_added_tokens=True).items()
              if not t.startswith("<0x")]
    chars = sorted(set(CORPUS))
    units = data.draw(st.lists(st.one_of(
        st.sampled_from(pieces).map(lambda i: [i]),
        st.sampled_from(chars).map(lambda c: [1 + b for b in c.encode()])),
        min_size=1, max_size=25))
    ends = [0]
    for unit in units:
        ends.append(ends[-1] + len(unit))
    return [i for unit in units for i in unit], set(ends)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_incremental_text_is_the_full_decode_at_every_step(name, data, skip_special_tokens):
    tokenizer = BUILT[name]
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    whole = None
    if name == "llama-byte-fallback":
        ids, whole = _byte_fallback_ids(data, tokenizer)
    else:
        ids = data.draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=40))
    # Mostly one token a step, as the engine appends them; sometimes several at once.
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    _check_every_step(tokenizer, ids, chunks, skip_special_tokens, whole)


def test_byte_fallback_invalid_run_differs():
    """The one known difference: byte tokens <0x00> <0x80> decode, together, to two U+FFFD (the
    decoder drops the whole invalid run), while <0x00> alone, settled a step earlier, was NUL.
    The incremental text keeps what it settled, as vLLM's incremental detokenizer does."""
    tokenizer = BUILT["llama-byte-fallback"]
    state = IncrementalText()
    for end in (1, 2):
        text = state.update(lambda ids: tokenizer.decode(list(ids)), [1, 1 + 0x80][:end])
    assert text == "\x00\ufffd" and tokenizer.decode([1, 1 + 0x80]) == "\ufffd\ufffd"


def test_incomplete_character_is_held_then_completed():
    """A 4-byte emoji one byte a step: U+FFFD while incomplete (as a full decode shows it), the
    character once its last byte arrives, and the window settles only then."""
    tokenizer = build_tokenizer()
    ids = list("a🙂".encode())  # the default model's id of a byte is its value
    state = _check_every_step(tokenizer, ids, [1] * len(ids), skip_special_tokens=True)
    assert state.text == "a🙂" and state.read_offset == len(ids)


def test_each_step_decodes_a_window_not_the_output():
    """The decoder sees a few tokens a step however long the output is: the work a step is
    bounded, not growing with the output (the reason this module exists)."""
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode(CORPUS * 20).ids
    longest = 0

    def decode(token_ids):
        nonlocal longest
        longest = max(longest, len(token_ids))
        return tokenizer.decode(list(token_ids))

    state = IncrementalText()
    for end in range(1, len(ids) + 1):
        state.update(decode, ids[:end])
    assert state.text == tokenizer.decode(ids) and len(ids) > 400
    assert longest <= 8, longest


def test_ids_that_shrink_are_refused():
    state = IncrementalText()
    state.update(lambda ids: "x" * len(ids), [1, 2, 3])
    with pytest.raises(ValueError, match="^ids: expected at least the 3 tokens"):
        state.update(lambda ids: "x" * len(ids), [1])
