"""The embedded default model's tokenizer: byte-level, 256 byte symbols plus three ChatML specials.

``python -m corun.serve`` with no ``--model`` serves the named model config ``corun-default``
(Qwen3-shaped, vocab 384, seeded random weights, see ``models``) with this tokenizer, so the server
starts in seconds on a laptop CPU with nothing downloaded. The weights are random: its text is
noise, but it is *deterministic* noise, which is what the server's tests and benchmarks need.

Token ids: ``0..255`` are the raw bytes (id = byte value), then ``256 <|endoftext|>``,
``257 <|im_start|>``, ``258 <|im_end|>``; ids ``259..383`` exist in the model's embedding but
never come out of ``encode``. The files in ``corun/assets/`` are written by
``python -m corun.default_model`` and loaded like any HF checkpoint's tokenizer (``tokenizer.json``
through the ``tokenizers`` package, the chat template from ``tokenizer_config.json``, the EOS ids
from ``generation_config.json``); a test
checks that the shipped files equal what this module builds.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL_NAME = "corun-default"
VOCAB_SIZE = 384
SPECIAL_TOKENS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
EOS_TOKEN_IDS = (256, 258)

# ChatML, as Qwen3 renders it (without the thinking blocks: the default model has none).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map: the ByteLevel pre-tokenizer alphabet.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upwards, so every
    byte is one visible symbol and the BPE model needs no unknown token.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    next_code = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(next_code)
            next_code += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE without merges: every byte is its own token, id = byte value."""
    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: with no merges the split would change nothing but speed,
    # and a prefix space would make encode(decode(ids)) != ids for every prompt.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(SPECIAL_TOKENS.items(), key=lambda item: item[1])
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text, _ in specials]
    )
    for text, token_id in specials:
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(
                f"special token {text} got id {tokenizer.token_to_id(text)}, expected {token_id}"
            )
    return tokenizer


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` beside ``tokenizer.json``: specials and the ChatML template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "add_bos_token": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": text,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for text, token_id in SPECIAL_TOKENS.items()
        },
    }


def asset_texts() -> dict[str, str]:
    """File name -> exact text of each shipped asset, as ``write_assets`` writes it."""
    return {
        "tokenizer.json": build_tokenizer().to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
        + "\n",
        # Both specials end a turn, as Qwen3's generation_config lists them; Tokenizer.from_dir
        # reads extra EOS ids from here.
        "generation_config.json": json.dumps({"eos_token_id": list(EOS_TOKEN_IDS)}, indent=2)
        + "\n",
    }


def write_assets(out_dir: Path | str = ASSETS_DIR) -> list[Path]:
    """Write the tokenizer files into ``out_dir`` (the package's ``assets/`` by default)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in asset_texts().items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_assets():
        print(f"wrote {written}")
