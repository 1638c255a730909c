"""Tokenizer: a HF ``tokenizers`` tokenizer.json plus the checkpoint's chat template.

``Tokenizer.from_dir(path)`` reads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja`` when present (it wins over the
config's template, as in transformers) and ``generation_config.json`` (extra EOS ids). The chat
template is rendered with jinja2 in a sandbox, with the variables HF templates expect.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Texts at least this long are encoded without holding the GIL (``Tokenizer.encode``).
RELEASE_GIL_CHARS = 1 << 16


def _token_text(value: object) -> str | None:
    """Special tokens appear as strings or as {"content": ...} dicts in tokenizer_config.json."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def decoder_types(tokenizer: Any) -> set[str]:
    """Every decoder type named in the ``decoder`` of ``tokenizer``'s tokenizer.json
    (``tokenizer.tokenizer``, a tokenizers.Tokenizer; Sequences walked), e.g. {"ByteLevel"} or
    {"Sequence", "Replace", "ByteFallback", "Fuse", "Strip"}; empty for anything else."""
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None or not hasattr(hf, "to_str"):
        return set()
    types: set[str] = set()
    pending = [json.loads(hf.to_str()).get("decoder")]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            types.add(node.get("type"))
            pending.extend(node.get("decoders", []) or [])
    return types


class Tokenizer:
    """encode / decode / apply_chat_template / eos_token_ids over one HF tokenizer."""

    def __init__(self, tokenizer: HFTokenizer, config: dict | None = None,
                 chat_template: str | None = None, extra_eos_ids: Sequence[int] = (),
                 has_generation_config: bool = False) -> None:
        self.tokenizer = tokenizer
        # Whether the checkpoint has a generation_config.json: then its EOS ids stand and the
        # model config's are not added (vLLM reads config.json's only when there is none).
        self.has_generation_config = has_generation_config
        self.config = config or {}
        self.chat_template = chat_template or self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos_token = bool(self.config.get("add_bos_token", False)) and self.bos_token
        # The tokenizer's own EOS, apart: it ends a sample with no stop_reason, the extra ids
        # (generation_config.json's) with their id (vLLM's update_from_generation_config).
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        ids = [t for t in [self.eos_token_id, *extra_eos_ids] if t is not None]
        self.eos_token_ids = tuple(dict.fromkeys(ids))
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {path}")
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file)
        eos = generation.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(HFTokenizer.from_file(str(tokenizer_file)), config, template, eos,
                   has_generation_config=generation_file.is_file())

    def info(self, model_max_length: int | None = None) -> dict[str, Any]:
        """``GET /tokenizer_info``'s body, as vLLM serves it: tokenizer_config.json's fields
        (``added_tokens_decoder`` left out: a remote tokenizer asks ``/tokenize`` for ids),
        special tokens as strings, the chat template in force and ``tokenizer_class``. A client
        tokenizing through the server (lm-evaluation-harness' ``tokenizer_backend=remote``)
        reads its EOS, BOS and chat template here."""
        info = {k: v for k, v in self.config.items() if k != "added_tokens_decoder"}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if name in info:
                info[name] = _token_text(info[name])
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if self.chat_template:
            info["chat_template"] = self.chat_template
        if model_max_length is not None:
            info["model_max_length"] = model_max_length
        return json.loads(json.dumps(info, default=str))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string of an id (byte-level BPE shows a space as ``Ġ``), as
        transformers' ``convert_ids_to_tokens``."""
        return self.tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= RELEASE_GIL_CHARS:
            # tokenizers' encode holds the GIL for the whole call (7.8 s for 3.2 MB of text with
            # the default model's tokenizer; another thread ran 6 times meanwhile); encode_batch
            # releases it, so the server's event loop runs on while a worker thread tokenizes a
            # long prompt. Same pipeline, same ids.
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            bos = self.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        """Render ``messages`` with the chat template; token ids (default) or the text.

        The rendered text already holds its special tokens, so no BOS is prepended again.
        """
        if not self.chat_template:
            raise ValueError("messages: this tokenizer has no chat template")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages: expected a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile_chat_template(source: str) -> Any:
    """A chat template compiled in the environment transformers renders it in (sandboxed; loop
    controls; its ``tojson``, which neither escapes HTML nor sorts keys, unlike Jinja's own;
    ``strftime_now``; ``raise_exception``; the ``{% generation %}`` block, which marks assistant
    text for training masks and renders its body as is), so a prompt renders to the same text
    as with HF."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
                lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise ValueError(f"messages: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def tokenizer_for_model(model: str) -> tuple[Tokenizer, bool]:
    """The tokenizer the server and ``LLM`` use for ``model``, and whether it is the embedded
    byte-level fallback of a named config of random weights (ids 0..258 are in every named
    config's vocabulary). ``ValueError`` for a checkpoint directory without ``tokenizer.json``."""
    from corun.default_model import ASSETS_DIR, DEFAULT_MODEL_NAME

    if model == DEFAULT_MODEL_NAME:
        return Tokenizer.from_dir(ASSETS_DIR), False
    if Path(model, "tokenizer.json").is_file():
        return Tokenizer.from_dir(model), False
    if Path(model).is_dir():
        raise ValueError(f"model: no tokenizer.json in the checkpoint directory {model}")
    return Tokenizer.from_dir(ASSETS_DIR), True
