"""OpenAI's ``response_format`` (text, JSON object, JSON schema), told apart by ``type``; any other
type is refused by name. vLLM's ``guided_*`` fields sit beside it in ``corun.api.protocol``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator, model_validator

from corun.api.request_base import StrictRequest, Text, check_json_strings
from corun.structured_output import StructuredOutput


class TextFormat(StrictRequest):
    type: Literal["text"]


class JsonObjectFormat(StrictRequest):
    type: Literal["json_object"]


class JsonSchema(StrictRequest):
    """OpenAI's ``response_format.json_schema``; the output matches ``schema`` whether or not
    ``strict`` is set (there is no best-effort mode)."""

    name: Text
    description: Text | None = None
    # "schema" would shadow BaseModel.schema.
    schema_: Annotated[dict[str, Any], AfterValidator(check_json_strings)] = Field(alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _compiles(self) -> JsonSchema:
        self.structured  # noqa: B018 - an unsupported schema is a 400 here, naming the field
        return self

    @property
    def structured(self) -> StructuredOutput:
        return StructuredOutput.from_schema(self.schema_, field="response_format.json_schema")


class JsonSchemaFormat(StrictRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchema


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class OtherFormat(StrictRequest):
    """A ``response_format`` of another type: refused by name."""

    type: Any

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: Any) -> Any:
        allowed = ", ".join(repr(t) for t in RESPONSE_FORMAT_TYPES)
        raise ValueError(f"not supported (only {allowed}; got {kind!r})")


def _format_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-format".replace("_", "-") if kind in RESPONSE_FORMAT_TYPES else "other-format"


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("text-format")]
    | Annotated[JsonObjectFormat, Tag("json-object-format")]
    | Annotated[JsonSchemaFormat, Tag("json-schema-format")]
    | Annotated[OtherFormat, Tag("other-format")],
    Discriminator(_format_kind),
]
# Per-request structured output: OpenAI's response_format and vLLM's guided_* fields.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
