"""mkdocs hook: the HTTP reference (``http-api.md``), rendered from the server's OpenAPI document.

The document is the one ``GET /openapi.json`` serves, taken from ``service.api.create_app`` at
build time (an embedded server that is built, never started: no Redis, no network), so the
page cannot drift from the routes and their schemas.
"""

from __future__ import annotations

import html
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PAGE = "http-api.md"
CODE = re.compile(r"(`+)(.+?)\1", re.S)
Schema = dict[str, Any]


def openapi() -> Schema:
    from service.api import create_app
    from service.config import Settings

    with tempfile.TemporaryDirectory() as data:  # the stores' folder, made and left unused
        settings = Settings(redis_url=None, answer_redis_url=None, model_dir=None, data_dir=data)
        doc: Schema = create_app(settings).openapi()
        return doc


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, PAGE, content=render(openapi())))
    return files


def text(value: str) -> str:
    """Prose for a table cell: one line, pipes and angle brackets outside code escaped."""
    parts = []
    last = 0
    for m in CODE.finditer(value):
        parts += [html.escape(value[last:m.start()], quote=False).replace("|", r"\|"), m.group(0)]
        last = m.end()
    parts.append(html.escape(value[last:], quote=False).replace("|", r"\|"))
    return " ".join("".join(parts).split())


def ref_name(schema: Schema) -> str:
    return str(schema["$ref"]).rsplit("/", 1)[-1]


def alternatives(schema: Schema, key: str) -> list[str]:
    """The kinds of an anyOf: a tensor's four wire forms as one, a value or a list of them."""
    alts = [s for s in schema[key] if s.get("type") != "null"]
    if any("$ref" in s and ref_name(s) == "TensorB64" for s in alts):
        alts = [s for s in alts if "$ref" not in s and s.get("type") not in (
            "array", "number", "integer")]
        return ["tensor", *(kind(s) for s in alts)]
    parts = [kind(s) for s in alts]
    listed = {p for p in parts if f"array of {p}" in parts}
    return [f"{p} (or a list of them)" if p in listed else p
            for p in parts if p in listed or p.removeprefix("array of ") not in listed]


def kind(schema: Schema) -> str:
    """A schema's type in a few words, other schemas as links."""
    if "$ref" in schema:
        name = ref_name(schema)
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(p for p in alternatives(schema, key) if p))
    if "const" in schema:
        return f"`{schema['const']!r}`" if schema["const"] != "" else "`''`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    t = schema.get("type")
    if t == "array":
        items = schema.get("items") or {}
        return f"array of {kind(items)}" if items else "array"
    if t == "object" and isinstance(schema.get("additionalProperties"), dict):
        return r"\{name: " + kind(schema["additionalProperties"]) + r"\}"  # escaped: not attr_list
    if isinstance(t, str):
        return t + (f" ({schema['format']})" if "format" in schema else "")
    return "any"


BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<",
          "minItems": "items >=", "maxItems": "items <=", "minLength": "length >=",
          "maxLength": "length <="}


def limits(schema: Schema) -> list[str]:
    """Bounds and patterns of a schema and of its alternatives."""
    out = [f"{op} {schema[key]}" for key, op in BOUNDS.items() if key in schema]
    if "pattern" in schema:
        out.append(f"pattern `{schema['pattern']}`")
    for alt in schema.get("anyOf", ()):
        out += limits(alt)
    return out


def field_row(name: str, schema: Schema, required: bool) -> str:
    notes = [text(schema.get("description", ""))]
    notes += [f"({', '.join(limits(schema))})"] if limits(schema) else []
    if "default" in schema and schema["default"] is not None:
        notes.append(f"default `{schema['default']!r}`")
    return (f"| `{name}` | {kind(schema)} | {'yes' if required else ''} | "
            f"{' '.join(n for n in notes if n)} |")


def operations(doc: Schema) -> Iterator[tuple[str, str, str, Schema]]:
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield (op.get("tags") or ["other"])[0], method.upper(), path, op


def render_operation(method: str, path: str, op: Schema, common: set[str]) -> list[str]:
    out = [f"### {method} `{path}`", "", f"**{op.get('summary', '')}**", ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            s = p.get("schema", {})
            desc = text(p.get("description") or s.get("description", ""))
            out.append(f"| `{p['name']}` | {p['in']} | {kind(s)} | "
                       f"{'yes' if p.get('required') else ''} | {desc} |")
        out.append("")
    body = op.get("requestBody")
    if body:
        out += ["Request body:", ""]
        out += [f"- `{ctype}`: {kind(c.get('schema', {}))}"
                for ctype, c in body.get("content", {}).items()]
        out.append("")
    out += ["| status | description | body |", "|---|---|---|"]
    for status, r in op.get("responses", {}).items():
        bodies = [f"`{ctype}` {kind(c.get('schema', {}))}"
                  for ctype, c in r.get("content", {}).items() if c.get("schema")]
        bodies += [f"header `{h}`" for h in r.get("headers", {}) if h not in common]
        out.append(f"| {status} | {text(r.get('description', ''))} | {'; '.join(bodies)} |")
    return [*out, ""]


def render_schema(name: str, schema: Schema) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [schema["description"].strip(), ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", ()))
        out += ["| field | type | required | description |", "|---|---|---|---|"]
        out += [field_row(k, v, k in required) for k, v in props.items()]
    else:
        out.append(f"Type: {kind(schema)}.")
    return [*out, ""]


def common_headers(doc: Schema) -> set[str]:
    """The headers that every response of every route declares."""
    sets = [set(r.get("headers", {})) for _, _, _, op in operations(doc)
            for r in op.get("responses", {}).values()]
    return set.intersection(*sets) if sets else set()


def render_headers(doc: Schema, common: set[str]) -> list[str]:
    headers = doc.get("components", {}).get("headers", {})
    if not headers:
        return []
    out = ["## Headers", "", "Every answer carries "
           + ", ".join(f"`{h}`" for h in sorted(common)) + "." if common else "", "",
           "| header | type | description |", "|---|---|---|"]
    out += [f"| `{name}` | {kind(h.get('schema', {}))} | {text(h.get('description', ''))} |"
            for name, h in headers.items()]
    return [*out, ""]


def render(doc: Schema) -> str:
    info = doc["info"]
    common = common_headers(doc)
    out = [
        "# HTTP API",
        "",
        f"{info.get('description', '').strip()}",
        "",
        f"This page is rendered from the server's OpenAPI document (version {info['version']}, "
        f"OpenAPI {doc['openapi']}), the one a running server serves at `GET /openapi.json` "
        "and shows at `/docs`. Requests and answers are JSON or safetensors "
        "(`Content-Type` / `Accept: application/x-safetensors`); every error is an "
        "[ErrorBody](#errorbody).",
        "",
    ]
    tags: dict[str, list[tuple[str, str, Schema]]] = {}
    for tag, method, path, op in operations(doc):
        tags.setdefault(tag, []).append((method, path, op))
    for tag, ops in tags.items():
        out += [f"## {tag[:1].upper()}{tag[1:]}", ""]
        for method, path, op in ops:
            out += render_operation(method, path, op, common)
    out += render_headers(doc, common)
    out += ["## Schemas", ""]
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += render_schema(name, schema)
    return "\n".join(out)
