"""The grammar mask of structured output: outlines-core's token automaton over the tokenizer.

A request's ``StructuredOutput`` regex with the engine's tokenizer compiles to an outlines-core
``Index`` (a DFA over token ids; expensive, so ``GrammarCompiler`` caches it per regex). Each
sequence keeps its own ``SequenceGuide`` over that index: before sampling, every token the guide
does not allow gets ``-inf`` (the first step of ``corun.logits_processing.process_rows``); after
the token is committed the guide advances by it (``LLMEngine._commit_part``). The guide's state is
a function of the sequence's own tokens only, so the mask, like every other per-request processor,
is independent of whatever runs beside the request.

In an accepting state the allowed set holds EOS (which stands for all of the engine's EOS ids);
once the match cannot grow, EOS is the only token left, so generation ends with finish_reason
"stop".
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import torch

from corun.structured_output import StructuredOutput, outlines_core
from corun.tokenizer import decoder_types

# -- the tokenizer's vocabulary as bytes ----------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    from corun.default_model import bytes_to_unicode

    return {symbol: byte for byte, symbol in bytes_to_unicode().items()}


_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, vocab_size: int, exclude: frozenset[int]) -> dict[int, bytes]:
    """Token id -> the raw bytes it stands for, for the ids below ``vocab_size`` that are not
    special tokens nor in ``exclude`` (EOS). Byte-level BPE tokens are mapped back through GPT-2's
    byte alphabet; SentencePiece tokens by ``▁`` -> space and ``<0xHH>`` -> that byte.
    ``ValueError`` for another kind of tokenizer."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None or not hasattr(hf, "get_vocab"):
        raise ValueError("needs a tokenizer (a tokenizers.Tokenizer) to build the grammar's "
                         "vocabulary")
    types = decoder_types(tokenizer)
    added = hf.get_added_tokens_decoder()
    special = {i for i, token in added.items() if token.special}
    byte_level = "ByteLevel" in types
    if not byte_level and not types & {"Metaspace", "ByteFallback", "Replace"}:
        names = ", ".join(sorted(map(str, types)))
        raise ValueError(f"not supported with this tokenizer: its decoder "
                         f"({names}) is neither byte-level nor SentencePiece")
    byte_of = _byte_decoder()
    out = {}
    for text, token_id in hf.get_vocab(with_added_tokens=True).items():
        if token_id >= vocab_size or token_id in special or token_id in exclude:
            continue
        if token_id in added:  # an added, non-special token is its text
            data = text.encode("utf-8")
        elif byte_level:
            data = (bytes(byte_of[c] for c in text) if all(c in byte_of for c in text)
                    else text.encode("utf-8"))
        else:
            match = _SPM_BYTE.fullmatch(text)
            data = bytes([int(match.group(1), 16)]) if match else \
                text.replace("\u2581", " ").encode("utf-8")
        if data:
            out[token_id] = data
    return out


class GrammarCompiler:
    """Builds (once) the outlines-core vocabulary of one tokenizer and caches the ``Index`` of
    each regex (LRU, ``max_indexes``). Thread-safe: the server validates, and so compiles, on
    worker threads while the engine thread makes guides."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int,
                 max_indexes: int = 32) -> None:
        self.tokenizer = tokenizer
        # The EOS ids the model can produce (a tokenizer's may lie beyond a named config's
        # vocabulary); the lowest is the vocabulary's EOS, and every one of them ends a match.
        self.eos_token_ids = tuple(sorted(t for t in eos_token_ids if 0 <= t < vocab_size))
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._vocabulary = None
        self._index = functools.lru_cache(maxsize=max_indexes)(self._build_index)

    def vocabulary(self):
        Vocabulary = outlines_core().Vocabulary

        with self._lock:
            if self._vocabulary is None:
                if not self.eos_token_ids:
                    raise ValueError("needs an EOS token to end a match; the engine has none")
                by_bytes: dict[bytes, list[int]] = {}
                exclude = frozenset(self.eos_token_ids)
                for token_id, data in token_bytes(self.tokenizer, self.vocab_size,
                                                  exclude).items():
                    by_bytes.setdefault(data, []).append(token_id)
                self._vocabulary = Vocabulary(self.eos_token_ids[0], by_bytes)
            return self._vocabulary

    def _build_index(self, regex: str):
        Index = outlines_core().Index

        # The match must end at the end of the output: without the anchor, outlines-core 0.2.14
        # drops the continuations of a state that already matches (after "a", ``a(bc)?`` and
        # ``(a|abc)`` allow only EOS), while ``[0-9]+`` happens to keep them.
        return Index(f"(?:{regex})$", self.vocabulary())

    def index(self, structured: StructuredOutput):
        """The compiled index of ``structured``'s regex; ValueError naming its field when there
        is no vocabulary, or the regex is invalid or cannot be written with this vocabulary."""
        try:
            self.vocabulary()
        except ValueError as exc:
            raise ValueError(f"{structured.field}: {exc}") from None
        try:
            return self._index(structured.regex)
        except ValueError as exc:
            detail = " ".join(str(exc).split())
            raise ValueError(f"{structured.field}: cannot compile to a token grammar: "
                             f"{detail}") from None

    def guide(self, structured: StructuredOutput) -> SequenceGuide:
        Guide = outlines_core().Guide

        return SequenceGuide(Guide(self.index(structured)), self.eos_token_ids)


class SequenceGuide:
    """One sequence's position in its grammar: the allowed-token mask and ``advance``."""

    def __init__(self, guide: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.guide = guide
        self.eos_token_ids = eos_token_ids
        self._eos = torch.tensor(eos_token_ids, dtype=torch.int64)
        self._bit_shifts = torch.arange(32, dtype=torch.int32)  # the mask's 32 bits per word
        # Set if a token the mask did not allow was committed anyway (the mask makes it
        # impossible; the guard keeps one broken sequence from failing the engine's step):
        # from then on only EOS is allowed.
        self.is_dead = False

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool on the CPU: the tokens allowed next (EOS when the match may end)."""
        words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        if not self.is_dead:
            self.guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        mask = ((words.view(-1, 1) >> self._bit_shifts) & 1).view(-1)[:vocab_size].bool()
        if mask[self._eos].any() or not mask.any():  # EOS stands for all EOS ids; a dead end stops
            mask[self._eos] = True
        return mask

    def advance(self, token_id: int) -> None:
        if token_id in self.eos_token_ids or self.is_dead:
            return
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:
            self.is_dead = True

    @property
    def is_finished(self) -> bool:
        return self.guide.is_finished()
