"""``ResponseFormat``: what a request's output must match, as the OpenAI API and the CLI say it.

Three ways to constrain an output, each one regular expression in the end (the rest of this
package turns that into a DFA over bytes and a token index):

* ``{"type": "regex", "regex": ...}``: the output matches the pattern in full (vLLM's
  ``guided_regex``; the CLI's ``--regex``);
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``:
  the output is a JSON text valid against the schema (the common subset that
  ``schema_to_regex`` supports; any other keyword is refused, named);
* ``{"type": "json_object"}``: any JSON object, nested at most ``ANY_DEPTH`` deep (a regular
  expression cannot count brackets without bound: see ``json_schema.json_object_regex``).

``{"type": "text"}`` (or None) means no constraint. The value is frozen and hashable, so it can
sit in ``SamplingParams``; it is checked when it is made, so a bad pattern or schema fails with
a message naming the problem before any request starts. ``strict`` is accepted either way:
the output always follows the schema (there is no "best effort" mode to be lenient in).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minillm.structured.json_schema import json_object_regex, schema_to_regex
from minillm.structured.regex import MAX_PATTERN_CHARS, parse

KINDS = ("regex", "json_schema", "json_object")


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output. ``pattern`` is the regex the whole output must match;
    ``schema`` the JSON Schema as JSON text (``json_schema`` only), ``name`` its name."""

    type: str
    pattern: str
    schema: str | None = None
    name: str | None = None

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        if not isinstance(pattern, str):
            raise TypeError(f"a regex must be a str, got {type(pattern).__name__}")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"the regex has {len(pattern):,} characters, more than {MAX_PATTERN_CHARS:,}")
        parse(pattern)  # a syntax error names its position now, not when a request starts
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: Any, name: str | None = None) -> ResponseFormat:
        """From a schema given as a dict (or bool) or as JSON text."""
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
        pattern = schema_to_regex(schema)  # SchemaError names an unsupported keyword and its path
        # Declared property order is kept (no sort_keys): the output follows it.
        return cls("json_schema", pattern, json.dumps(schema, ensure_ascii=False), name)

    @classmethod
    def json_object(cls) -> ResponseFormat:
        return cls("json_object", json_object_regex())

    @classmethod
    def parse(cls, value: Any) -> ResponseFormat | None:
        """From the OpenAI ``response_format`` object (a dict), a ``ResponseFormat``, or None."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"response_format must be a dict such as {{'type': 'json_object'}}, "
                            f"got {type(value).__name__}")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "regex":
            return cls.regex(value.get("regex"))  # type: ignore[arg-type]
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping) or "schema" not in spec:
                raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise TypeError(f"json_schema.name must be a str, got {type(name).__name__}")
            return cls.json_schema(spec["schema"], name)
        raise ValueError(f"response_format type must be one of 'text', {', '.join(repr(k) for k in KINDS)}; "
                         f"got {str(kind)[:80]!r}")
