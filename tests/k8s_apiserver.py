"""A small stand-in for the Kubernetes API server: the resource.k8s.io/v1 endpoints the
DRA driver uses, over real HTTP (stdlib http.server in a thread).

    GET    /apis/resource.k8s.io/v1/namespaces/NS/resourceclaims/NAME
    GET    /apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName=N,spec.driver=D
    POST   /apis/resource.k8s.io/v1/resourceslices
    PUT    /apis/resource.k8s.io/v1/resourceslices/NAME
    DELETE /apis/resource.k8s.io/v1/resourceslices/NAME

Every object it receives, and every claim a test stores, is checked against the
Kubernetes OpenAPI schema of every version the driver claims (strict: unknown
fields are errors), plus the rules the real API server's validation adds for a
ResourceSlice that a schema cannot say (names, attribute forms, limits,
immutable fields). A bad object gets 422 with the problems, as the real server
answers, and is kept in `rejected`, which the tests assert stays empty. Updates
need the current resourceVersion (409 otherwise), as on a real server.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from k8s_schema import DRA_VERSIONS, problems

PREFIX = "/apis/resource.k8s.io/v1"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUANTITY = re.compile(r"[+-]?[0-9]+(\.[0-9]*)?([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")


def _dns_subdomain(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in name.split("."))


def slice_rules(obj: dict[str, Any]) -> list[str]:
    """What the API server's ResourceSlice validation checks beyond the schema."""
    out = []
    name = obj.get("metadata", {}).get("name", "")
    if not _dns_subdomain(name):
        out.append(f"metadata.name {name!r}: not a DNS subdomain")
    spec = obj.get("spec", {})
    if not _dns_subdomain(spec.get("driver", "")):
        out.append(f"spec.driver {spec.get('driver')!r}: not a DNS subdomain")
    where = [
        k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)
    ]
    if len(where) != 1:
        out.append(
            f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection; got {where}"
        )
    pool = spec.get("pool", {})
    if (
        not pool.get("name")
        or pool.get("generation", -1) < 0
        or pool.get("resourceSliceCount", 0) < 1
    ):
        out.append(f"spec.pool {pool}: needs a name, generation >= 0, resourceSliceCount >= 1")
    devices = spec.get("devices") or []
    if len(devices) > 128:
        out.append(f"spec.devices: {len(devices)} > 128")
    names = [d.get("name", "") for d in devices]
    if len(set(names)) != len(names):
        out.append(f"spec.devices: duplicate names {names}")
    for i, d in enumerate(devices):
        at = f"spec.devices[{i}]"
        if not _DNS_LABEL.fullmatch(d.get("name", "")) or len(d["name"]) > 63:
            out.append(f"{at}.name {d.get('name')!r}: not a DNS label")
        attrs, caps = d.get("attributes") or {}, d.get("capacity") or {}
        if len(attrs) + len(caps) > 32:
            out.append(f"{at}: more than 32 attributes and capacities")
        for key in [*attrs, *caps]:
            ident = key.rsplit("/", 1)[-1]
            if not _C_IDENT.fullmatch(ident) or len(ident) > 32:
                out.append(f"{at}: {key!r} is not a C identifier of at most 32 characters")
        for key, value in attrs.items():
            if sorted(value) not in (["bool"], ["int"], ["string"], ["version"]):
                out.append(f"{at}.attributes.{key}: exactly one of bool, int, string, version")
            if len(str(value.get("string", ""))) > 64:
                out.append(f"{at}.attributes.{key}.string: longer than 64")
        for key, value in caps.items():
            if not _QUANTITY.fullmatch(str(value.get("value", ""))):
                out.append(f"{at}.capacity.{key}.value {value.get('value')!r}: not a quantity")
    return out


class ApiServer:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        self.rejected: list[str] = []
        self.requests: list[tuple[str, str, int]] = []
        self.changed = threading.Condition()
        self._rv = itertools.count(1)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> ApiServer:
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                    "users": [{"name": "driver", "user": {"token": "stand-in"}}],
                    "contexts": [
                        {"name": "stand-in", "context": {"cluster": "stand-in", "user": "driver"}}
                    ],
                    "current-context": "stand-in",
                }
            )
        )
        return path

    # ---- what tests do -----------------------------------------------------------

    def put_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Store a claim as the scheduler would leave it (allocated); it must be valid."""
        bad = self.check(claim)
        assert not bad, f"the test's own claim is invalid: {bad}"
        claim = copy.deepcopy(claim)
        meta = claim["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._rv))
        with self.changed:
            self.claims[(meta["namespace"], meta["name"])] = claim
        return claim

    def wait_for(self, predicate: Callable[[ApiServer], Any], timeout: float = 30.0) -> Any:
        """Until `predicate(self)` is truthy; woken by every change the driver makes."""
        with self.changed:
            result = self.changed.wait_for(lambda: predicate(self), timeout)
        assert result, f"the API server never saw that within {timeout} s; slices: {self.slices}"
        return result

    def check(self, obj: dict[str, Any]) -> list[str]:
        out = [f"{v}: {p}" for v in DRA_VERSIONS for p in problems(obj, v)]
        if obj.get("kind") == "ResourceSlice":
            out += slice_rules(obj)
        return out

    # ---- the endpoints -----------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        parts = path.removeprefix(PREFIX).strip("/").split("/")
        if (
            method == "GET"
            and len(parts) == 4
            and parts[0] == "namespaces"
            and parts[2] == "resourceclaims"
        ):
            claim = self.claims.get((parts[1], parts[3]))
            if claim is None:
                return _status(HTTPStatus.NOT_FOUND, f'resourceclaims "{parts[3]}" not found')
            return 200, claim
        if parts[0] != "resourceslices":
            return _status(
                HTTPStatus.NOT_FOUND, f"no such endpoint in the stand-in: {method} {path}"
            )
        with self.changed:
            result = self._slices(method, parts[1:], query, body)
            self.changed.notify_all()
        return result

    def _slices(
        self, method: str, rest: list[str], query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if method == "GET" and not rest:
            want = dict(t.split("=", 1) for t in query.get("fieldSelector", "").split(",") if t)
            unknown = set(want) - {"spec.nodeName", "spec.driver"}
            if unknown:
                return _status(HTTPStatus.BAD_REQUEST, f"field label not supported: {unknown}")
            items = [
                s for s in self.slices.values()
                if all(s["spec"].get(k.split(".")[1]) == v for k, v in want.items())
            ]  # fmt: skip
            return 200, {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": str(next(self._rv))}, "items": items,
            }  # fmt: skip
        if method in ("POST", "PUT"):
            bad = self.check(body)
            if bad:
                self.rejected.extend(bad)
                return _status(HTTPStatus.UNPROCESSABLE_ENTITY, "; ".join(bad))
        if method == "POST" and not rest:
            name = body["metadata"]["name"]
            if name in self.slices:
                return _status(HTTPStatus.CONFLICT, f'resourceslices "{name}" already exists')
            body["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)))
            self.slices[name] = body
            return 201, body
        if method == "PUT" and len(rest) == 1:
            old = self.slices.get(rest[0])
            if old is None:
                return _status(HTTPStatus.NOT_FOUND, f'resourceslices "{rest[0]}" not found')
            if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
                return _status(HTTPStatus.CONFLICT, "the object has been modified")
            for key in ("driver", "nodeName"):
                if body["spec"].get(key) != old["spec"].get(key):
                    bad = [f"spec.{key}: field is immutable"]
                    self.rejected.extend(bad)
                    return _status(HTTPStatus.UNPROCESSABLE_ENTITY, bad[0])
            body["metadata"].update(uid=old["metadata"]["uid"], resourceVersion=str(next(self._rv)))
            self.slices[rest[0]] = body
            return 200, body
        if method == "DELETE" and len(rest) == 1:
            gone = self.slices.pop(rest[0], None)
            if gone is None:
                return _status(HTTPStatus.NOT_FOUND, f'resourceslices "{rest[0]}" not found')
            return 200, gone
        return _status(
            HTTPStatus.METHOD_NOT_ALLOWED, f"{method} {PREFIX}/resourceslices/{'/'.join(rest)}"
        )


def _status(code: HTTPStatus, message: str) -> tuple[int, Any]:
    return code.value, {
        "apiVersion": "v1", "kind": "Status", "status": "Failure",
        "message": message, "reason": code.phrase.replace(" ", ""), "code": code.value,
    }  # fmt: skip


def _handler(server: ApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
                code, out = server.handle(self.command, url.path, query, body)
            except Exception as e:  # the stand-in's own bug: make it loud in the test
                server.rejected.append(f"stand-in failed on {self.command} {self.path}: {e!r}")
                code, out = _status(HTTPStatus.INTERNAL_SERVER_ERROR, repr(e))
            server.requests.append((self.command, self.path, code))
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
