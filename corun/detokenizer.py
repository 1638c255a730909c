"""Incremental detokenization: a sequence's output text grows by decoding the few tokens of a
moving window each step, not its whole output (vLLM's ``detokenize_incrementally``).

Decoding every output token again each step costs O(n) a step, O(n^2) a request: 128 sequences
of 8,192 tokens took 74 ms a step on this project's CPU, 0.19 ms incrementally
(experiments/results/detokenize-cpu.json), so long RL rollouts would spend more host time
decoding than their GPU step takes. The window keeps two offsets into the ids:
``prefix_offset`` (context for the decoder, already part of ``text``) and ``read_offset`` (where
the unsettled tokens begin). Each step decodes ``ids[prefix_offset:read_offset]`` and
``ids[prefix_offset:]``; the difference is the new text. It settles (joins ``text``, and the
window moves on) unless it ends in U+FFFD, the decoder's stand-in for a UTF-8 sequence that a
later token may still complete.

``IncrementalText.update`` returns what ``decode(ids)`` returns, the trailing U+FFFD of an
incomplete character included (the property tests in tests/engine/test_detokenizer.py check
this at every step for byte-level BPE, SentencePiece-style Metaspace, Llama's byte-fallback
chain, and special tokens, skipped or not): the engine's stop-string check and output settling
read it as they read a full decode. One exception, shared with vLLM: a byte-fallback decoder
turns a whole run of byte tokens into U+FFFD when the run is not valid UTF-8, so a full decode
may take back a byte the window already settled; the incremental text keeps it. The window
grows while it settles nothing (tokens that decode to nothing, or an invalid byte run), which
a trained model's output rarely does for long.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from corun.outputs import REPLACEMENT_CHAR


@dataclass
class IncrementalText:
    """One sequence's detokenization state: ``text`` is the decode of ``ids[:read_offset]``;
    ``last`` the (token count, text) of the latest update, so that a second call for the same
    ids (the engine's stop check, then the step's output) decodes nothing."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    last: tuple[int, str] = (0, "")

    def update(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> str:
        """The text of ``ids``, which extend the ids of every earlier call on this state."""
        if len(ids) < self.read_offset:
            raise ValueError(f"ids: expected at least the {self.read_offset} tokens already "
                             f"decoded, got {len(ids)}")
        if len(ids) != self.last[0]:
            self.last = (len(ids), self._decode_new(decode, ids))
        return self.last[1]

    def _decode_new(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> str:
        if len(ids) == self.read_offset:
            return self.text
        prefix_text = decode(ids[self.prefix_offset:self.read_offset])
        window_text = decode(ids[self.prefix_offset:])
        # A decoder may rewrite the window's start once more tokens follow (a Metaspace
        # decoder's leading space, say): the new text is then what the window adds past the
        # old one, as in vLLM.
        new_text = window_text[len(prefix_text):]
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return self.text
        return self.text + new_text
