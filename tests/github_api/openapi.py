"""GitHub's own OpenAPI description of its REST API, and the checks of a request and a response
against it.

The description is the one GitHub publishes (github/rest-api-description), as the npm package
``@octokit/openapi`` ships it: version ``VERSION`` (23.0.2), file ``generated/api.github.com.json``
(OpenAPI 3.0.3, the api.github.com plan; ``$ref`` kept, resolved here through ``referencing``). It is
installed with npm into ``<repo>/.fleet/cache/octokit-openapi`` once; parallel test workers
(pytest-xdist) serialise the install with a file lock, later runs reuse it (as tests/supabase_cli.py
does for the Supabase CLI).

``Description`` is loaded once per process (``description()``). Schemas are OpenAPI 3.0 schemas
(``nullable``, ``readOnly``/``writeOnly``): they are checked with ``openapi-schema-validator``'s
OAS 3.0 validators, one compiled per operation and status (or request body) on first use.

Where the description and api.github.com differ, the check follows api.github.com: GitHub answers
*any* operation with 401 (missing or bad credentials), with 403 or 429 at a primary or secondary
rate limit, and a GET carrying If-None-Match with 304 when the ETag matches; the description
declares those on a few operations only. So an undeclared 401, a 403/429 that is a rate-limit
answer (``x-ratelimit-remaining: 0`` or a ``retry-after`` header) and a 304 to a conditional GET are
accepted, their bodies checked against the description's ``basic-error``. Any other undeclared
status is a problem.

One reading of OpenAPI 3.0 is also settled by what api.github.com sends: a schema with
``nullable: true`` accepts null even where it has an ``enum`` without null (``state_reason``,
``conclusion``) or an ``anyOf``/``oneOf``/``allOf`` (a commit's ``author``); the strict OAS 3.0.3
reading (and the validator) would refuse the nulls GitHub sends there. ``_nullable`` rewrites those
schemas once, when the description is loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from jsonschema.protocols import Validator
from npmkit import npm_install
from openapi_schema_validator import OAS30ReadValidator, OAS30WriteValidator, oas30_format_checker
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

PACKAGE = "@octokit/openapi"
VERSION = "23.0.2"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".fleet" / "cache" / "octokit-openapi"
FILE = Path("node_modules") / "@octokit" / "openapi" / "generated" / "api.github.com.json"
DOC_URI = "urn:github-rest-api-description"  # the description's base URI for its "#/..." references

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# what api.github.com answers on every operation, declared or not (module docstring)
ANY_OPERATION = {"401", "403", "429"}
BASIC_ERROR = {"$ref": "#/components/schemas/basic-error"}


class NpmUnavailable(Exception):
    """npm is not on PATH: the description cannot be installed here."""


def _installed(folder: Path) -> str | None:
    manifest = folder / "node_modules" / "@octokit" / "openapi" / "package.json"
    if not (folder / FILE).is_file() or not manifest.is_file():
        return None
    try:
        return str(json.loads(manifest.read_text(encoding="utf-8")).get("version"))
    except (OSError, ValueError):
        return None


def ensure_description(folder: Path = CACHE) -> Path:
    """The path of ``api.github.com.json``, installing ``@octokit/openapi@VERSION`` if needed.

    Raises NpmUnavailable if npm is missing; any other install failure is a RuntimeError.
    """
    npm_install(folder, PACKAGE, VERSION, lambda: _installed(folder), NpmUnavailable)
    return folder / FILE


@dataclass(frozen=True)
class Operation:
    """One operation of the description: ``GET /repos/{owner}/{repo}/issues`` and what it takes."""

    id: str  # operationId, e.g. "issues/list-for-repo"
    method: str  # upper case
    template: str  # the path template
    params: Mapping[str, Mapping[str, Any]] = field(repr=False)  # "in:name" -> parameter object
    spec: Mapping[str, Any] = field(repr=False)  # the operation object as the description has it

    def query(self) -> dict[str, Mapping[str, Any]]:
        return {p["name"]: p for p in self.params.values() if p["in"] == "query"}

    def path_params(self) -> dict[str, Mapping[str, Any]]:
        return {p["name"]: p for p in self.params.values() if p["in"] == "path"}


def _json_of(body: bytes | str | None) -> tuple[bool, Any]:
    if body is None or body in (b"", ""):
        return False, None
    return True, json.loads(body)


def _lower(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (headers or {}).items()}


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() in ("application/json",
                                                                  "application/vnd.github+json")


def _where(error: Any) -> str:
    return "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)


def _nullable(node: Any) -> Any:
    """The description with ``nullable: true`` accepting null beside an enum or a composition."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.get("nullable") is True:
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        if any(k in out for k in ("anyOf", "oneOf", "allOf")):
            rest = {k: v for k, v in out.items() if k != "nullable"}
            return {"anyOf": [{"enum": [None]}, rest]}
    return out


def _rooted(schema: Any) -> Any:
    """``schema`` (inline in an operation) with its "#/components/..." references made absolute
    (``DOC_URI#/...``): they point into the description, not into the inline schema."""
    if isinstance(schema, dict):
        return {k: DOC_URI + v if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rooted(v)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rooted(v) for v in schema]
    return schema


class Description:
    """The operations of the description, and the checks of traffic against them."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        doc = _nullable(doc)
        self.doc = doc
        self.version = str(doc.get("info", {}).get("version"))
        self._registry: Registry[Any] = Registry().with_resource(
            DOC_URI, Resource.from_contents(doc, default_specification=DRAFT4)
        )
        self._lock = threading.Lock()
        self._validators: dict[tuple[str, str, str], Validator] = {}
        self._found: dict[tuple[str, str], Operation | None] = {}
        self._seen: dict[tuple[tuple[str, str, str], bytes], list[tuple[str, str]]] = {}
        # by segment count: (literal segments first) (regex, template, method -> operation)
        self._routes: dict[int, list[tuple[re.Pattern[str], str, dict[str, Operation]]]] = {}
        for template, item in doc["paths"].items():
            shared = item.get("parameters", [])
            ops: dict[str, Operation] = {}
            for method in METHODS:
                if method in item:
                    ops[method.upper()] = self._operation(method, template, item[method], shared)
            segments = template.strip("/").split("/")
            pattern = "/".join(
                "[^/]+" if s.startswith("{") and s.endswith("}") else re.escape(s) for s in segments
            )
            self._routes.setdefault(len(segments), []).append(
                (re.compile(f"/{pattern}"), template, ops)
            )
        for routes in self._routes.values():  # /issues/comments before /issues/{issue_number}
            routes.sort(key=lambda r: -sum(not s.startswith("{") for s in r[1].split("/")))

    # -- reading the description

    def resolve(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        """``obj`` with its ``$ref`` (to a component of the description) followed."""
        while "$ref" in obj:
            node: Any = self.doc
            for part in obj["$ref"].removeprefix("#/").split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            obj = node
        return obj

    def _operation(self, method: str, template: str, op: Mapping[str, Any],
                   shared: list[Mapping[str, Any]]) -> Operation:
        params: dict[str, Mapping[str, Any]] = {}
        for raw in [*shared, *op.get("parameters", [])]:
            p = self.resolve(raw)
            params[f"{p['in']}:{p['name']}"] = p
        return Operation(op["operationId"], method.upper(), template, params, op)

    def operation(self, method: str, path: str) -> Operation | None:
        """The operation of ``method`` and ``path`` (a path or URL; its query is ignored), or None."""
        path = urlsplit(path).path or "/"
        key = (method.upper(), path)
        if key not in self._found:
            segments = path.strip("/").split("/")
            found = None
            for pattern, _template, ops in self._routes.get(len(segments), []):
                if pattern.fullmatch(path) and key[0] in ops:
                    found = ops[key[0]]
                    break
            with self._lock:
                self._found[key] = found
        return self._found[key]

    def _validator(self, key: tuple[str, str, str], schema: Mapping[str, Any],
                   write: bool) -> Validator:
        found = self._validators.get(key)
        if found is None:
            cls = OAS30WriteValidator if write else OAS30ReadValidator
            found = cls(schema, registry=self._registry, format_checker=oas30_format_checker)
            with self._lock:
                self._validators[key] = found
        return found

    def _schema_problems(self, key: tuple[str, str, str], schema: Mapping[str, Any], instance: Any,
                         write: bool) -> list[str]:
        return [f"{where or '(the whole body)'}: {message}"
                for where, message in self._errors(key, schema, instance, write)[:20]]

    def _errors(self, key: tuple[str, str, str], schema: Mapping[str, Any], instance: Any,
                write: bool) -> list[tuple[str, str]]:
        """``instance`` against ``schema``: (where, message) pairs. A list's items are checked one
        by one, and each distinct item (or other instance) once per process: clients poll the same
        objects again and again."""
        resolved = self.resolve(schema)
        if isinstance(instance, list) and resolved.get("type") == "array" and "items" in resolved:
            found: list[tuple[str, str]] = []
            for n, item in enumerate(instance):
                found += [(f"[{n}]{where}", message) for where, message in
                          self._errors((*key[:2], key[2] + "[]"), resolved["items"], item, write)]
                if len(found) >= 20:
                    break
            return found
        digest = hashlib.sha1(json.dumps(instance, sort_keys=True).encode()).digest()
        seen = self._seen.get((key, digest))
        if seen is not None:
            return seen
        validator = self._validator(key, _rooted(schema), write)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
        found = [(_where(e), e.message[:300]) for e in errors[:20]]
        with self._lock:
            if len(self._seen) > 100_000:
                self._seen.clear()
            self._seen[(key, digest)] = found
        return found

    def _value_problems(self, op: Operation, where: str, name: str, raw: list[str],
                        schema: Mapping[str, Any]) -> list[str]:
        schema = self.resolve(schema)
        kind = schema.get("type")
        values: list[Any] = []
        for text in raw:
            try:
                if kind == "integer":
                    values.append(int(text))
                elif kind == "number":
                    values.append(float(text))
                elif kind == "boolean":
                    if text not in ("true", "false"):
                        raise ValueError(text)
                    values.append(text == "true")
                elif kind == "array":
                    values.append(text.split(","))
                else:
                    values.append(text)
            except ValueError:
                return [f"{where} parameter {name}={text!r} is not of type {kind}"]
        if len(values) > 1 and kind != "array":
            return [f"{where} parameter {name} is given {len(values)} times"]
        problems = []
        for value in values:
            for p in self._schema_problems((op.id, f"{where}:{name}", ""), schema, value, write=True):
                problems.append(f"{where} parameter {name}={value!r}: {p.split(': ', 1)[-1]}")
        return problems

    # -- the checks

    def request_problems(self, method: str, url: str, headers: Mapping[str, str] | None = None,
                         body: bytes | str | None = None) -> list[str]:
        """What in this request the description does not allow (empty: a valid request)."""
        parts = urlsplit(url)
        path = parts.path or "/"
        op = self.operation(method, path)
        if op is None:
            return [f"{method.upper()} {path}: no operation of the description has this method and path"]
        problems: list[str] = []
        # path parameters
        names = re.findall(r"{([^}]+)}", op.template)
        values = [unquote(v) for v in path.strip("/").split("/")]
        segments = op.template.strip("/").split("/")
        given = {s[1:-1]: v for s, v in zip(segments, values, strict=True) if s.startswith("{")}
        for name in names:
            spec = op.path_params().get(name)
            if spec is not None:
                problems += self._value_problems(op, "path", name, [given[name]], spec["schema"])
        # query parameters
        known = op.query()
        query = parse_qs(parts.query, keep_blank_values=True)
        for name, raw in query.items():
            if name not in known:
                problems.append(f"unknown query parameter {name!r} (known: {', '.join(sorted(known)) or 'none'})")
                continue
            problems += self._value_problems(op, "query", name, raw, known[name]["schema"])
        for name, spec in known.items():
            if spec.get("required") and name not in query:
                problems.append(f"required query parameter {name!r} is missing")
        # body
        h = _lower(headers)
        request_body = self.resolve(op.spec["requestBody"]) if "requestBody" in op.spec else None
        try:
            has_body, data = _json_of(body)
        except ValueError:
            has_body, data = True, None
            problems.append("the body is not JSON")
        if request_body is None:
            if has_body:
                problems.append("a body was sent, but the operation takes none")
        elif not has_body:
            if request_body.get("required"):
                problems.append("the operation requires a body; none was sent")
        else:
            content = request_body.get("content", {})
            if not _is_json(h.get("content-type")):
                problems.append(f"the body's content-type is {h.get('content-type')!r}, not application/json")
            if "application/json" in content and "schema" in content["application/json"]:
                schema = content["application/json"]["schema"]
                problems += [f"body {p}" for p in
                             self._schema_problems((op.id, "request", ""), schema, data, write=True)]
        return [f"{op.method} {path} ({op.id}): {p}" for p in problems]

    def response_problems(self, operation: Operation, status: int, headers: Mapping[str, str] | None,
                          body: bytes | str | None, *, conditional: bool = False) -> list[str]:
        """What in this response the operation's description does not allow (empty: valid).

        ``conditional``: the request carried If-None-Match (then a 304 is allowed on any GET)."""
        code = str(status)
        h = _lower(headers)
        responses = operation.spec["responses"]
        problems: list[str] = []
        declared = responses.get(code) or responses.get(f"{code[0]}XX") or responses.get("default")
        try:
            has_body, data = _json_of(body)
        except ValueError:
            has_body, data = True, None
            if _is_json(h.get("content-type")):
                problems.append("the body is not JSON")
        rate_limited = h.get("x-ratelimit-remaining") == "0" or "retry-after" in h
        if status == 304:
            if has_body:
                problems.append("a 304 has a body")
            if declared is None and not (operation.method == "GET" and conditional):
                problems.append("304 to a request without If-None-Match")
        elif declared is None:
            if code == "401" or (code in ("403", "429") and rate_limited):
                problems += [f"body {p}" for p in
                             self._schema_problems(("*", code, "basic"), BASIC_ERROR, data, write=False)]
            else:
                problems.append(f"status {code} is not declared (declared: {', '.join(responses)})")
        else:
            content = self.resolve(declared).get("content", {})
            schema = content.get("application/json", {}).get("schema")
            if schema is not None:
                if not _is_json(h.get("content-type")):
                    problems.append(f"content-type {h.get('content-type')!r}, not application/json")
                elif not has_body:
                    problems.append("no body; the description gives a JSON body")
                else:
                    problems += [f"body {p}" for p in
                                 self._schema_problems((operation.id, code, ""), schema, data,
                                                       write=False)]
            elif not content and has_body:
                problems.append(f"a {code} with a body; the description gives none")
        return [f"{operation.method} {operation.template} ({operation.id}) -> {code}: {p}"
                for p in problems]


@cache
def description() -> Description:
    """The description, installed if needed and loaded once per process."""
    path = ensure_description()
    return Description(json.loads(path.read_text(encoding="utf-8")))
