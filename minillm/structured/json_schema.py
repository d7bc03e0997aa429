"""JSON Schema -> a regular expression (notebook 13, step 4).

A JSON Schema describes a *language* of JSON texts; for the common subset that language is
regular, so it can be written as one regex and compiled by the same NFA -> DFA -> token index
machinery as any user pattern. Each keyword maps to a piece of regex:

==========================  ================================================================
schema                      regex (``ws`` is the whitespace rule below)
==========================  ================================================================
``boolean`` / ``null``      ``(true|false)`` / ``null``
``integer``                 ``-?(0|[1-9][0-9]*)``
``number``                  the integer, then ``(\\.[0-9]+)?([eE][+-]?[0-9]+)?``
``string``                  ``"`` + characters ``{minLength,maxLength}`` + ``"``, where a
                            character is anything but ``"``, ``\\`` and controls, or one of
                            the escapes ``\\" \\\\ \\/ \\b \\f \\n \\r \\t``
``string`` + ``pattern``    ``"(pattern)"`` (``^``/``$`` dropped: the pattern spans the quotes)
``string`` + ``format``     date, time, date-time (RFC 3339, the offset required), uuid, email
``enum`` / ``const``        the values' compact JSON, as literals, in alternation
``array``                   ``\\[ ws (item (ws , ws item){min-1,max-1})? ws \\]``
``object``                  the ``properties`` in their declared order, each ``"key" ws : ws
                            value``, the ``required`` ones mandatory, commas between
``anyOf`` / ``oneOf``       alternation (``oneOf``'s "exactly one" is not enforced)
``$ref``                    local references (``#``, ``#/$defs/X``, ``#/definitions/X``)
==========================  ================================================================

Choices, and why:

* **Whitespace**: ``ws = [ ]?``, one optional space after ``{``/``[``, around ``:`` and ``,``
  and before ``}``/``]`` (outlines' default). Models like to write ``{"a": 1}``; forbidding
  the space pushes them off their usual tokens, while unbounded whitespace (``[ \\n\\t]*``)
  lets a small model pad with spaces or newlines until ``max_tokens``. Pass ``whitespace=``
  another pattern (``""`` for compact JSON) to change it.
* **No ``\\uXXXX`` escapes** in strings: the model writes any character itself, raw UTF-8.
  Each character a length-bounded string may hold costs DFA states (9 each, most of them for
  the UTF-8 continuation bytes); the six of a ``\\u`` escape would make that 15, and
  ``maxLength`` up to about 1,100 fits in ``MAX_DFA_STATES`` instead of about 650.
* **Property order is fixed** (the declared order): JSON objects are unordered, but all
  orders of n optional properties is a regex n! long. The same choice as outlines and OpenAI.
* **No extra properties** when ``properties`` are given (``additionalProperties`` false by
  default, OpenAI's strict mode); ``additionalProperties: true`` or a schema appends
  ``(, "any key": value)*``. An object schema *without* properties is any object.
* **Recursion is bounded, not refused**: a ``$ref`` that is already being expanded
  ``max_recursion_depth`` times becomes the empty language, and the branches that need it are
  dropped (an optional property, an array's items beyond the empty array, an ``anyOf``
  alternative): a regex cannot count nesting, so a recursive schema is unrolled a few levels.
  Why nesting needs a stack (a pushdown automaton) is the next lesson of notebook 13.
* **Any JSON value** (``{}``, ``true``, an untyped array item) and ``json_object`` mode use a
  bounded-depth regex, not a pushdown automaton: it reuses the DFA machinery unchanged, and at
  depth 3 (``ANY_DEPTH``: objects or arrays inside objects or arrays, three levels) its
  minimal DFA is 330 states for an object, 670 for any value. A free value inside the schema's
  own objects and arrays gets the depth that is left (``ANY_DEPTH`` minus the containers
  around it, at least 1), so the whole document stays within about ``ANY_DEPTH`` levels and
  the subset construction within its limit (every copy of the value in the regex is a copy of
  its NFA: one free depth-3 value is already 5,000 DFA states before minimization).

Unsupported keywords raise ``SchemaError`` naming the keyword and where it is
(``#/properties/age``): the server answers 400 with that message. Annotations (``title``,
``description``, ``default``, ``examples``...) are ignored.
"""

from __future__ import annotations

import json
from typing import Any

from minillm.structured.regex import MAX_PATTERN_CHARS, GrammarTooLarge, RegexError, escape, parse

WHITESPACE = r"[ ]?"
STRING_CHAR = r'(?:[^"\\\x00-\x1F]|\\["\\/bfnrt])'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = "null"
ANY_DEPTH = 3  # containers inside containers for "any JSON value"
MAX_RECURSION_DEPTH = 2
MAX_SCHEMA_DEPTH = 32  # subschemas inside subschemas (the builder recurses once per level)

# Days per month, February up to 29 (a 29th in a year that is not a leap year gets through: the
# leap rule as a regex is long and the year is rarely what a model gets wrong).
_DATE = (r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-9]))")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[Tt]" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}",
}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "discriminator"}
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
# The keywords each type reads; anything else (minimum, uniqueItems, patternProperties...) is refused.
KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(), "number": set(), "boolean": set(), "null": set(),
}
GENERIC = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable"}


class SchemaError(ValueError):
    """A schema outside the supported subset, or malformed; the message names the keyword and path."""


def schema_to_regex(schema: Any, whitespace: str = WHITESPACE,
                    max_recursion_depth: int = MAX_RECURSION_DEPTH) -> str:
    """The regex of the JSON texts ``schema`` allows (a dict, bool or JSON string)."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"the schema is not valid JSON: {err}") from None
    regex = _Builder(schema, whitespace, max_recursion_depth).value(schema, "#")
    if regex is None:
        raise SchemaError("the schema allows no value at all (false, or only an unbounded recursion)")
    return regex


def json_value_regex(depth: int = ANY_DEPTH, whitespace: str = WHITESPACE) -> str:
    """Any JSON value with containers nested at most ``depth`` deep."""
    return _Builder({}, whitespace, 0).any_value(depth)


def json_object_regex(depth: int = ANY_DEPTH, whitespace: str = WHITESPACE) -> str:
    """``response_format={"type": "json_object"}``: any JSON object, nested at most ``depth`` deep."""
    return _Builder({}, whitespace, 0).any_object(depth)


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def _literal(value: Any) -> str:
    return escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


class _Builder:
    def __init__(self, root: Any, whitespace: str, max_recursion_depth: int) -> None:
        self.root, self.ws, self.max_depth = root, whitespace, max_recursion_depth
        self.expanding: list[str] = []  # the $refs being expanded, outermost first
        self.depth = 0
        self.containers = 0  # the schema's own objects and arrays around the current subschema
        # Every regex built counts: a schema whose references fan out (each expansion holding
        # several more) grows exponentially, and is stopped at the first piece over the budget.
        self.written = 0

    def count(self, regex: str | None) -> str | None:
        self.written += len(regex or "")
        if self.written > MAX_PATTERN_CHARS:
            raise GrammarTooLarge("the schema's regex (characters written)", self.written,
                                  "MAX_PATTERN_CHARS", MAX_PATTERN_CHARS)
        return regex

    def error(self, path: str, message: str) -> SchemaError:
        return SchemaError(f"{message} (at {path})")

    # --------------------------------------------------------------------------- any value
    def any_value(self, depth: int) -> str:
        scalars = [_group([f'"{STRING_CHAR}*"', NUMBER, BOOLEAN, NULL])]
        if depth > 0:
            scalars += [self.any_array(depth), self.any_object(depth)]
        return self.count(_group(scalars))  # type: ignore[return-value]

    def any_array(self, depth: int) -> str:
        return self.array_of(self.any_value(depth - 1), 0, None)

    def any_object(self, depth: int) -> str:
        member = f'"{STRING_CHAR}*"{self.ws}:{self.ws}' + self.any_value(depth - 1)
        sep = f"{self.ws},{self.ws}"
        return rf"\{{{self.ws}(?:{member}(?:{sep}{member})*)?{self.ws}\}}"

    def array_of(self, item: str | None, low: int, high: int | None) -> str | None:
        open_, close, sep = rf"\[{self.ws}", rf"{self.ws}\]", f"{self.ws},{self.ws}"
        if item is None or high == 0:
            return open_ + close if low == 0 else None
        more = f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        body = f"{item}(?:{sep}{item}){more}"
        return open_ + (body if low > 0 else f"(?:{body})?") + close

    # --------------------------------------------------------------------------- schemas
    def value(self, schema: Any, path: str) -> str | None:
        """The regex of ``schema``; None when it allows nothing (``false``, a cut recursion)."""
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise GrammarTooLarge(f"the schema's nesting (at {path})", self.depth + 1, "MAX_SCHEMA_DEPTH",
                                  MAX_SCHEMA_DEPTH)
        self.depth += 1
        try:
            return self.count(self.value_of(schema, path))
        finally:
            self.depth -= 1

    def value_of(self, schema: Any, path: str) -> str | None:
        if schema is True or schema == {}:
            return self.any_value(self.free_depth())
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise self.error(path, f"a schema must be an object or a boolean, got {schema!r}")
        if "$ref" in schema:
            return self.reference(schema, path)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise self.error(path, "'allOf' with other than exactly one schema is not supported")
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            if set(merged) - ANNOTATIONS:
                raise self.error(path, "'allOf' next to other keywords is not supported")
            return self.value(parts[0], path + "/allOf/0")
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise self.error(path, "'enum' must be a non-empty list")
            return _group([_literal(v) for v in values])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise self.error(path, f"'{key}' must be a non-empty list of schemas")
                found = [r for i, s in enumerate(options) if (r := self.value(s, f"{path}/{key}/{i}")) is not None]
                return _group(found) if found else None
        types = schema.get("type")
        if types is None:
            types = ("object" if "properties" in schema or "additionalProperties" in schema else
                     "array" if "items" in schema else
                     "string" if {"pattern", "format", "minLength", "maxLength"} & set(schema) else None)
            if types is None:
                self.check_keywords(schema, path, set())
                return self.any_value(self.free_depth())
        types = [types] if isinstance(types, str) else list(types)
        if schema.get("nullable") is True and "null" not in types:
            types.append("null")
        unknown = [t for t in types if t not in TYPES]
        if unknown or not types:
            raise self.error(path, f"unsupported 'type' {unknown[0] if unknown else types!r}")
        self.check_keywords(schema, path, set().union(*(KEYWORDS[t] for t in types)))
        found = [r for t in types if (r := getattr(self, "type_" + t)(schema, path)) is not None]
        return _group(found) if found else None

    def free_depth(self) -> int:
        return max(ANY_DEPTH - self.containers, 1)

    def inside(self, schema: Any, path: str) -> str | None:
        """The regex of a subschema one container deeper."""
        self.containers += 1
        try:
            return self.value(schema, path)
        finally:
            self.containers -= 1

    def check_keywords(self, schema: dict, path: str, allowed: set[str]) -> None:
        for key in schema:
            if key not in allowed and key not in GENERIC and key not in ANNOTATIONS:
                raise self.error(path, f"the keyword '{key}' is not supported")

    def reference(self, schema: dict, path: str) -> str | None:
        ref = schema["$ref"]
        if set(schema) - ANNOTATIONS - {"$ref"}:
            raise self.error(path, "'$ref' next to other keywords is not supported")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(path, f"only local references (#/...) are supported, got '$ref': {ref!r}")
        if self.expanding.count(ref) >= self.max_depth:
            return None  # the recursion is cut here: this branch allows nothing
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise self.error(path, f"the reference {ref!r} points to nothing")
        self.expanding.append(ref)
        try:
            return self.value(target, ref)
        finally:
            self.expanding.pop()

    def type_null(self, schema: dict, path: str) -> str:
        return NULL

    def type_boolean(self, schema: dict, path: str) -> str:
        return BOOLEAN

    def type_integer(self, schema: dict, path: str) -> str:
        return INTEGER

    def type_number(self, schema: dict, path: str) -> str:
        return NUMBER

    def type_string(self, schema: dict, path: str) -> str | None:
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise self.error(path, f"the 'format' {schema['format']!r} is not supported "
                                       f"(supported: {', '.join(FORMATS)})")
            return f'"{FORMATS[schema["format"]]}"'
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise self.error(path, "'pattern' must be a string")
            pattern = pattern.removeprefix("^")
            if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
                pattern = pattern[:-1]  # (an anchor, not an escaped dollar: an even number of backslashes before it)
            try:
                parse(pattern)
            except RegexError as err:
                raise self.error(path, f"its 'pattern': {err}") from None
            return f'"(?:{pattern})"'
        low, high = self.bounds(schema, path, "minLength", "maxLength")
        if high is not None and high < low:
            return None
        count = "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else high}}}"
        return f'"{STRING_CHAR}{count}"'

    def bounds(self, schema: dict, path: str, low_key: str, high_key: str) -> tuple[int, int | None]:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for key, v in ((low_key, low), (high_key, high)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise self.error(path, f"'{key}' must be a non-negative integer, got {v!r}")
        return low, high

    def type_array(self, schema: dict, path: str) -> str | None:
        low, high = self.bounds(schema, path, "minItems", "maxItems")
        if high is not None and high < low:
            return None
        items = schema.get("items", True)
        if isinstance(items, list):
            raise self.error(path, "'items' as a list (tuple validation) is not supported")
        return self.array_of(self.inside(items, path + "/items"), low, high)

    def type_object(self, schema: dict, path: str) -> str | None:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise self.error(path, "'properties' must be an object and 'required' a list")
        if missing := [name for name in required if name not in properties]:
            raise self.error(path, f"'required' names {missing[0]!r}, which is not in 'properties'")
        extra = schema.get("additionalProperties", not properties)
        colon, sep = f"{self.ws}:{self.ws}", f"{self.ws},{self.ws}"
        members: list[tuple[str, bool]] = []  # (regex of '"key": value', required)
        if not properties and extra in (True, {}):
            return self.any_object(self.free_depth())
        for name, sub in properties.items():
            value = self.inside(sub, f"{path}/properties/{name}")
            if value is None:
                if name in required:
                    return None
                continue
            members.append((_literal(name) + colon + value, name in required))
        more = ""
        if extra is not False:
            value = self.inside(extra, path + "/additionalProperties")
            if value is not None:
                more = f'"{STRING_CHAR}*"{colon}{value}'
        open_, close = rf"\{{{self.ws}", rf"{self.ws}\}}"
        tail = f"(?:{sep}{more})*" if more else ""
        first_required = next((i for i, (_, req) in enumerate(members) if req), None)
        if first_required is not None:  # optional ones before it end with a comma, the rest start with one
            body = "".join(f"(?:{m}{sep})?" for m, _ in members[:first_required]) + members[first_required][0]
            body += "".join(f"{sep}{m}" if req else f"(?:{sep}{m})?" for m, req in members[first_required + 1 :])
            return open_ + body + tail + close
        # all optional: choose which member comes first, the later ones may follow it
        firsts = [m + "".join(f"(?:{sep}{later})?" for later, _ in members[i + 1 :]) + tail
                  for i, (m, _) in enumerate(members)]
        if more:
            firsts.append(more + tail)
        return open_ + (f"(?:{'|'.join(firsts)})?" if firsts else "") + close
