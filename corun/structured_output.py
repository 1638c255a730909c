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
import re
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
            return _full_match_regex(self.spec, self.field)
        if self.kind == "choice":
            return "(" + "|".join(_escape(c) for c in self.spec) + ")"
        _check_schema(json.loads(self.spec), self.field, "")
        return _schema_regex(self.spec, self.field)


def _full_match_regex(regex: str, field: str) -> str:
    """A guided regex as the grammar compiles it: it matches the whole output, so a leading
    ``^`` and a trailing unescaped ``$`` are dropped (clients send them; the compiler refuses
    them). One that matches the empty string is refused: the grammar anchors the match at the
    output's end, which outlines-core cannot build for an empty match."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex[:-1]) - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:  # an odd count escapes the dollar itself
            regex = regex[:-1]
    try:
        matches_empty = re.fullmatch(regex, "") is not None
    except re.error:
        matches_empty = False  # Rust syntax Python does not read: the compiler judges it
    if matches_empty:
        raise ValueError(f"{field}: a regex that matches the empty string is not supported "
                         f"(make it match at least one character)")
    return regex


# Keywords outlines-core's schema compiler accepts and ignores: refused rather than served
# unenforced (checked against its grammar: minimum 0 allowed -3, uniqueItems allowed [1, 1]).
_UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
    "maxProperties", "contains", "minContains", "maxContains", "dependentRequired",
    "propertyNames"})
# String formats whose patterns let a quote, a backslash or a control character into the string
# (so the output would not be JSON): "uri" (any non-space in its userinfo and path), "time".
_UNSAFE_FORMATS = frozenset({"uri", "time"})
# Escapes that can match a quote, a backslash or a control character (or, \\x and \\u, any
# character): inside a JSON string they would end it or break it.
_UNSAFE_ESCAPES = frozenset('SWDsPpntrfv0xu"\\')


def _class_is_unsafe(items: str) -> bool:
    """Whether a positive character class's items (between its brackets) admit a quote, a
    backslash or a control character: listed, escaped, or inside a range."""
    chars, i = [], 0
    while i < len(items):
        if items[i] == "\\":
            if i + 1 >= len(items) or items[i + 1] in _UNSAFE_ESCAPES:
                return True
            chars.append(items[i + 1])
            i += 2
            continue
        if i + 2 < len(items) and items[i + 1] == "-" and items[i + 2] != "\\":
            low, high = ord(items[i]), ord(items[i + 2])
            if low < 0x20 or low <= 0x22 <= high or low <= 0x5C <= high:
                return True
            i += 3
            continue
        chars.append(items[i])
        i += 1
    return any(c in '"\\' or ord(c) < 0x20 for c in chars)


def _pattern_can_break_string(pattern: str) -> bool:
    """Whether ``pattern`` can match a quote, a backslash or a control character (``.``, a
    negated class, ``\\s \\S \\W \\D \\p``, ``\\n``, a class or range that holds one): inside a
    JSON string such a character would end it or break it."""
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            if i + 1 >= len(pattern) or pattern[i + 1] in _UNSAFE_ESCAPES:
                return True
            i += 2
            continue
        if char == "[":
            end = i + 2 if pattern[i + 1 : i + 2] == "]" else i + 1  # "[]...]": a literal "]"
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            items = pattern[i + 1 : end]
            if items.startswith("^") or _class_is_unsafe(items):
                return True
            i = end + 1
            continue
        if char in '."' or ord(char) < 0x20:
            return True
        i += 1
    return False


# Keywords whose value maps names to schemas, and those whose value is a schema or a list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def _check_schema(node: object, field: str, path: str) -> None:
    """ValueError naming ``field`` and the keyword's path for what outlines-core would compile
    to a grammar that does not enforce it, or that lets the output stop being JSON."""
    if not isinstance(node, dict):
        return
    where = f"{field}{path}"
    for key in node:
        if key in _UNENFORCED:
            raise ValueError(f"{where}: the JSON-schema keyword {key!r} is not supported (the "
                             f"grammar compiler does not enforce it)")
    if node.get("format") in _UNSAFE_FORMATS:
        raise ValueError(f"{where}: format {node['format']!r} is not supported (its pattern "
                         f"lets a quote or a backslash into the string)")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _pattern_can_break_string(pattern):
        raise ValueError(f"{where}: pattern {pattern!r} is not supported: it can match a quote, "
                         f"a backslash or a control character ('.', a negated class, \\s, \\S, "
                         f"\\W, \\D, ...), which would end the JSON string; list the characters "
                         f"it may match instead")
    if "enum" in node and "const" in node:
        raise ValueError(f"{where}: 'const' with 'enum' is not supported (the compiler keeps "
                         f"only one of them)")
    required = node.get("required")
    if isinstance(required, list):
        missing = [name for name in required if name not in (node.get("properties") or {})]
        if missing:
            raise ValueError(f"{where}: required {missing} not in 'properties' (the compiler "
                             f"would drop the requirement)")
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check_schema(sub, field, f"{path}.{key}.{name}")
    for key in _SCHEMA_VALUES:
        _check_schema(node.get(key), field, f"{path}.{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check_schema(sub, field, f"{path}.{key}[{i}]")


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
