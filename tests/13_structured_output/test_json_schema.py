"""JSON Schema -> regex (notebook 13, step 4): every text the regex accepts is JSON that the
``jsonschema`` validator accepts (sampled at random from the DFA), hand-written valid and
invalid documents land on the right side, recursion is unrolled to the stated depth, any-value
and json_object modes are bounded, and every unsupported keyword is named with its path."""

from __future__ import annotations

import datetime
import json
import random
import uuid

import pytest
from helpers.structured import sample_match

from minillm.structured import SchemaError, compile_regex, json_object_regex, json_value_regex, schema_to_regex

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8}, "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"}, "scores": {"type": "array", "items": {"type": "number"}}}},
    "all_optional": {"type": "object", "properties": {
        "a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"enum": ["x", 2, None, [1, "y"], {"k": False}]}}},
    "middle_required": {"type": "object", "required": ["b"], "properties": {
        "a": {"type": "integer"}, "b": {"const": "fixed"}, "c": {"type": "number"}}},
    "array_bounds": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2}$"}, "minItems": 2, "maxItems": 4},
    "refs": {"type": "object", "required": ["home"], "properties": {"home": {"$ref": "#/$defs/Addr"},
             "work": {"$ref": "#/definitions/Addr"}},
             "$defs": {"Addr": {"type": "object", "required": ["city"], "properties": {
                 "city": {"type": "string"}, "zip": {"type": ["string", "null"], "maxLength": 5}}}},
             "definitions": {"Addr": {"$ref": "#/$defs/Addr"}}},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                         {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]}]},
    "extra_props": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                    "additionalProperties": {"type": "integer"}},
    "free_object": {"type": "object"},
    "formats": {"type": "object", "required": ["d", "t", "dt", "u"], "properties": {
        "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"},
        "dt": {"type": "string", "format": "date-time"}, "u": {"type": "string", "format": "uuid"}}},
    "tree": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}},
    "pydantic_style": {"title": "Model", "description": "what pydantic writes", "type": "object",
                       "properties": {"x": {"title": "X", "default": 1, "type": "integer"},
                                      "y": {"allOf": [{"$ref": "#/$defs/Y"}], "description": "wrapped"}},
                       "required": ["y"], "$defs": {"Y": {"enum": ["p", "q"], "title": "Y", "type": "string"}}},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_accepted_text_validates(name):
    """Random texts from the schema's DFA: JSON, and valid by the ``jsonschema`` validator."""
    schema = SCHEMAS[name]
    dfa = compile_regex(schema_to_regex(schema))
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(name)
    for _ in range(300):
        text = sample_match(dfa, rng, max_len=rng.choice([5, 30, 80])).decode("utf-8")
        value = json.loads(text)
        errors = list(validator.iter_errors(value))
        assert not errors, (text, errors[0].message)
        if name == "formats":  # jsonschema checks formats only with extra packages: check by hand
            # (Python 3.11 wants T and Z upper case and no leap second; February 29 is let through
            # in every year, as the format's regex says)
            stamp = value["dt"].upper().replace(":60", ":59")
            for date in (value["d"], stamp[:10]):
                datetime.date.fromisoformat(date.replace("-02-29", "-02-28"))
            datetime.datetime.fromisoformat(stamp.replace("-02-29", "-02-28"))
            uuid.UUID(value["u"])


VALID = {
    "person": ['{"name": "Ann", "age": 30}', '{"name":"Bo","age":-1,"email":"b@x.io","scores":[1.5, 2e3]}',
               '{ "name" : "é日", "age" : 0 , "scores" : [ ] }'],
    "all_optional": ["{}", '{"c": [1,"y"]}', '{"a": true, "c": {"k":false}}', '{"b": null}'],
    "middle_required": ['{"b": "fixed"}', '{"a": 1, "b": "fixed", "c": 1.5e-3}'],
    "array_bounds": ['["ab", "cd"]', '["ab","cd","ef","gh"]'],
    "refs": ['{"home": {"city": "Paris", "zip": null}, "work": {"city": "Lyon"}}'],
    "any_of": ["12", "[true, false]", '"ab"', "null"],
    "extra_props": ['{"id": 1}', '{"id": 1, "x": 2, "y": 3}'],
    "free_object": ["{}", '{"a": [1, {"b": null}], "c": "d"}'],
    "tree": ['{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]}'],
    "pydantic_style": ['{"y": "p"}', '{"x": 5, "y": "q"}'],
}
INVALID = {
    "person": ['{"age": 30, "name": "Ann"}', '{"name": "", "age": 30}', '{"name": "Ann"}',
               '{"name": "123456789", "age": 1}', '{"name": "Ann", "age": 1.5}', '{"name": "Ann", "age": 01}',
               '{"name": "A", "age": 1, "other": 2}', '{"name":"A",  "age":1}', '{"name": "a\nb", "age": 1}'],
    "all_optional": ['{"c": "z"}', '{"c": [1, "y"], "a": true}', '{,}'],
    "middle_required": ['{"a": 1}', '{"b": "other"}'],
    "array_bounds": ['["ab"]', '["ab","cd","ef","gh","ij"]', '["abc", "de"]'],
    "refs": ['{"home": {}}', '{"home": {"city": "P", "zip": "123456"}}'],
    "any_of": ['"abc"', "[true, true, true]", "1.5"],
    "extra_props": ['{"x": 2}', '{"id": 1, "x": "two"}'],
    "free_object": ["[]", "1", '{"a": [[[[1]]]]}'],  # the last is deeper than ANY_DEPTH
    "tree": ['{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}'],  # deeper than MAX_RECURSION_DEPTH
    "pydantic_style": ['{"x": 5}', '{"y": "r"}'],
}


@pytest.mark.parametrize("name", list(VALID))
def test_hand_written_documents(name):
    dfa = compile_regex(schema_to_regex(SCHEMAS[name]))
    for text in VALID[name]:
        assert dfa.matches(text.encode()), text
    for text in INVALID.get(name, []):
        assert not dfa.matches(text.encode()), text


def test_the_whitespace_rule_can_be_changed():
    schema = SCHEMAS["middle_required"]
    compact = compile_regex(schema_to_regex(schema, whitespace=""))
    assert compact.matches(b'{"a":1,"b":"fixed"}') and not compact.matches(b'{"a": 1,"b":"fixed"}')
    loose = compile_regex(schema_to_regex(schema, whitespace=r"[ \n]{0,3}"))
    assert loose.matches(b'{\n  "b": "fixed"\n}')


def test_recursion_depth_is_a_parameter():
    deeper = compile_regex(schema_to_regex(SCHEMAS["tree"], max_recursion_depth=3))
    assert deeper.matches(INVALID["tree"][0].encode())
    once = compile_regex(schema_to_regex(SCHEMAS["tree"], max_recursion_depth=1))
    assert once.matches(b'{"v": 1, "kids": []}') and not once.matches(VALID["tree"][0].encode())


def test_json_object_mode_is_any_object_to_a_bounded_depth():
    dfa = compile_regex(json_object_regex())
    for text in ['{}', '{"a": 1, "b": [true, null, "x"], "c": {"d": {"e": 1.5}}}', '{"k": []}']:
        assert dfa.matches(text.encode()), text
    for text in ['[]', '"s"', '{"a": {"b": {"c": {"d": 1}}}}', '{"a" 1}', "{'a': 1}"]:
        assert not dfa.matches(text.encode()), text
    assert dfa.n_states < 1000  # the depth-3 bound keeps the minimal DFA small
    value = compile_regex(json_value_regex(1))
    assert value.matches(b'[1, "a"]') and value.matches(b'{"k": 1}') and not value.matches(b"[[1]]")


UNSUPPORTED = [
    ({"type": "integer", "minimum": 0}, r"the keyword 'minimum' is not supported \(at #\)"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}, r"'multipleOf' .* #/properties/n"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {"type": "string"}, "then": {}}, "'if'"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' with other than exactly one"),
    ({"$ref": "https://example.com/s.json"}, "only local references"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "array", "items": [{"type": "string"}]}, "tuple validation"),
    ({"type": "string", "format": "hostname"}, "'format' 'hostname'"),
    ({"type": "string", "pattern": "(a)\\1"}, r"'pattern': the backreference"),
    ({"type": "decimal"}, "unsupported 'type' 'decimal'"),
    ({"type": "object", "required": ["x"], "properties": {}}, "'required' names 'x'"),
    ({"type": "string", "maxLength": -1}, "'maxLength' must be a non-negative integer"),
    ({"enum": []}, "'enum' must be a non-empty list"),
    ("{not json", "not valid JSON"),
    (False, "allows no value"),
]


@pytest.mark.parametrize("schema, message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_schemas_name_the_keyword_and_where(schema, message):
    with pytest.raises(SchemaError, match=message):
        schema_to_regex(schema)


def test_a_schema_may_be_given_as_json_text():
    assert schema_to_regex(json.dumps(SCHEMAS["person"])) == schema_to_regex(SCHEMAS["person"])
