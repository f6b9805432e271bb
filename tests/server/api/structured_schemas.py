"""Twenty JSON schemas of varied shape for the structured-output tests: nested objects, arrays,
enums, required and optional fields, numbers and integers with bounds, strings with lengths and
patterns, booleans, nulls, unions and references. Strings carry a maxLength and arrays a maxItems
so that a small model's output completes within the tests' max_tokens."""

S = {"type": "string", "maxLength": 12}

SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 999},
                                                                                "name": S},
                                               "required": ["id", "name"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "y": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["kind", "x", "y"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "null"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": S, "c": {"type": "null"}},
     "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]},
                                      "priority": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["status", "priority"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 6}}, "required": ["word"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"name": S, "nick": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 1, "maximum": 3}, "flags": {"type": "array", "maxItems": 2,
                                                                             "items": {"type": "boolean"}}},
        "required": ["version", "flags"]}, "title": S}, "required": ["meta", "title"]},
]
