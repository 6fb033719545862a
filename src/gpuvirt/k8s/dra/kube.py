"""The API server, through the official `kubernetes` client: claims and slices.

Objects travel as plain JSON dicts (`_preload_content=False` on reads), so
that what the driver sees is what the API server sent, opaque parameters
included, with no model classes in between.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from gpuvirt.errors import GpuvirtError


class KubeError(GpuvirtError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """From `kubeconfig`, else the pod's service account (the DaemonSet), else $KUBECONFIG."""
    cfg = client.Configuration()
    try:
        if kubeconfig is not None:
            kube_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        else:
            try:
                kube_config.load_incluster_config(client_configuration=cfg)
            except kube_config.ConfigException:
                kube_config.load_kube_config(client_configuration=cfg)
    except (kube_config.ConfigException, OSError) as e:
        where = kubeconfig or "the service account or $KUBECONFIG"
        raise KubeError(f"no usable API server configuration in {where}: {e}") from None
    return client.ApiClient(cfg)


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.resource = client.ResourceV1Api(api)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            resp = fn(*args, _preload_content=False, **kwargs)
        except ApiException as e:
            raise KubeError(
                f"{what}: {e.status} {e.reason}: {_message(e.body)}", e.status
            ) from None
        except (OSError, urllib3.exceptions.HTTPError) as e:
            raise KubeError(f"{what}: API server unreachable ({e})") from None
        data = resp.data
        return json.loads(data) if data else {}

    def claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call(
            f"reading ResourceClaim {namespace}/{name}",
            self.resource.read_namespaced_resource_claim, name, namespace,
        )  # fmt: skip

    def slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        doc = self._call(
            f"listing ResourceSlices of node {node}",
            self.resource.list_resource_slice,
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
        )
        return doc.get("items") or []

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            f"creating ResourceSlice {name}", self.resource.create_resource_slice, body
        )

    def replace_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            f"updating ResourceSlice {name}", self.resource.replace_resource_slice, name, body
        )

    def delete_slice(self, name: str) -> None:
        try:
            self._call(f"deleting ResourceSlice {name}", self.resource.delete_resource_slice, name)
        except KubeError as e:
            if e.status != 404:
                raise


def _message(body: Any) -> str:
    try:
        return json.loads(body)["message"]
    except (ValueError, KeyError, TypeError):
        return str(body)[:300]
