"""Structured output: what a request's output must match (JSON schema, any JSON object, regex,
choice), as the regular expression the grammar mask is compiled from (``corun.grammar``).

Pure Python (the schema compiler is outlines-core's ``build_regex_from_schema``): SamplingParams
holds a ``StructuredOutput`` and validates it at construction, before the request reaches the
engine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from types import ModuleType

KINDS = ("json_schema", "json_object", "regex", "choice")

# A JSON value's pieces (the patterns of outlines-core's JSON-schema compiler), with at most one
# optional space where JSON allows whitespace, so that a generation cannot pad forever.
_WS = r"[ ]?"
_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_NUMBER = r"((-)?(0|[1-9][0-9]*))(\.[0-9]+)?([eE][+-][0-9]+)?"
_SCALAR = rf"({_STRING}|{_NUMBER}|(true|false)|null)"


def _object_of(value: str) -> str:
    member = rf"{_STRING}{_WS}:{_WS}{value}"
    return rf"\{{{_WS}({member}({_WS},{_WS}{member})*)?{_WS}\}}"


def _array_of(value: str) -> str:
    return rf"\[{_WS}({value}({_WS},{_WS}{value})*)?{_WS}\]"


def json_object_regex(depth: int = 2) -> str:
    """Any JSON object nesting at most ``depth`` objects or arrays (the top one included).

    Depth 2 compiles in 0.15 s for a 256-token vocabulary; depth 3, like outlines' schema-free
    object pattern, takes 8 s there, and a real vocabulary multiplies both."""
    value = _SCALAR
    for _ in range(depth - 1):
        value = rf"({_SCALAR}|{_object_of(value)}|{_array_of(value)})"
    return _object_of(value)


_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _escape(text: str) -> str:
    """``text`` as a literal in outlines-core's (Rust) regex syntax: metacharacters backslashed,
    control characters spelled ``\\x{HH}`` (``re.escape`` puts a backslash before a raw
    newline, which that syntax reads differently)."""
    out = []
    for char in text:
        code = ord(char)
        if code < 0x20 or code == 0x7F:
            out.append(f"\\x{{{code:x}}}")
        else:
            out.append("\\" + char if char in _META else char)
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    - ``kind`` "json_schema": ``spec`` is the schema as JSON text (``from_schema`` takes a dict);
    - "json_object": any JSON object (``spec`` None);
    - "regex": ``spec`` is the pattern (outlines-core's Rust syntax, matched in full);
    - "choice": ``spec`` is a tuple of strings, the output is exactly one of them.

    ``field`` names the request field it came from, for errors (``guided_json``,
    ``response_format.json_schema``; ``structured`` offline). Construction compiles the regex, so
    an unsupported schema raises ``ValueError`` naming ``field`` here, before any work.
    """

    kind: str
    spec: str | tuple[str, ...] | None = None
    field: str = dataclasses.field(default="structured", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind in ("json_schema", "regex") and not isinstance(self.spec, str):
            raise ValueError(f"{self.field}: expected a str spec, got {type(self.spec).__name__}")
        if self.kind == "choice" and not (isinstance(self.spec, tuple) and self.spec and all(
                isinstance(c, str) and c for c in self.spec)):
            raise ValueError(f"{self.field}: expected a non-empty tuple of non-empty strings, "
                             f"got {self.spec!r}")
        if self.kind == "json_object" and self.spec is not None:
            raise ValueError(f"{self.field}: json_object takes no spec")
        _ = self.regex  # compile the schema now: a bad one fails here, naming the field

    @classmethod
    def from_schema(cls, schema: dict | str, field: str = "structured") -> StructuredOutput:
        """A JSON schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"{field}: the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{field}: the schema must be a JSON object, "
                             f"got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), field)

    @classmethod
    def from_choices(cls, choices: list[str] | tuple[str, ...],
                     field: str = "structured") -> StructuredOutput:
        return cls("choice", tuple(choices), field)

    @functools.cached_property
    def regex(self) -> str:
        if self.kind == "json_object":
            return json_object_regex()
        if self.kind == "regex":
            return self.spec
        if self.kind == "choice":
            return "(" + "|".join(_escape(c) for c in self.spec) + ")"
        return _schema_regex(self.spec, self.field)


_IMPORT_LOCK = threading.Lock()


def outlines_core() -> ModuleType:
    """outlines-core, imported on first use (only structured output needs it) under a lock: its
    ``__init__`` registers ``outlines_core.json_schema`` in ``sys.modules`` last, so a request
    thread importing that name while another thread is still in the package's ``__init__`` gets a
    ModuleNotFoundError (seen with 64 concurrent clients)."""
    with _IMPORT_LOCK:
        import outlines_core as module
    return module


@functools.lru_cache(maxsize=64)
def _schema_regex(schema: str, field: str) -> str:
    build_regex_from_schema = outlines_core().json_schema.build_regex_from_schema
    try:
        return build_regex_from_schema(schema)
    except (ValueError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"{field}: unsupported or invalid JSON schema: {detail}") from None
