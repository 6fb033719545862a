"""The Kubernetes OpenAPI schema (as kubernetes-validate ships it), with validators cached.

kubernetes_validate.validate() reads the 1.5 MB definitions file on every call;
the API-server stand-in checks every object it receives, so the validators are
built once per (version, kind) here, from the same files, in strict mode (an
unknown field is an error, as the API server's strict field validation makes it).
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import Any

import jsonschema
from kubernetes_validate.utils import all_versions
from referencing import Registry, Resource

# resource.k8s.io/v1 is served from Kubernetes 1.34 on.
DRA_VERSIONS = tuple(v for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 34))


def _dir(version: str) -> Any:
    return (
        resources.files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{version}-local-strict"
    )


@functools.cache
def _definitions(version: str) -> Registry:
    defs = json.loads((_dir(version) / "_definitions.json").read_text())
    return Resource.from_contents(defs) @ Registry()


@functools.cache
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Draft202012Validator:
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    path = _dir(version) / f"{kind.lower()}-{group}.json"
    schema = json.loads(path.read_text())
    registry = Resource.from_contents(schema) @ _definitions(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def problems(obj: dict[str, Any], version: str) -> list[str]:
    """Every way `obj` breaks the schema of its kind in Kubernetes `version`."""
    try:
        validator = _validator(version, obj["kind"], obj["apiVersion"])
    except (KeyError, FileNotFoundError) as e:
        return [f"no schema for {obj.get('apiVersion')}/{obj.get('kind')} in {version}: {e}"]
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(obj)
    ]
