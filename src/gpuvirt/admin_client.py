"""Talks to the host's admin endpoint (HTTP over a Unix socket or TCP)."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from gpuvirt.config import HostSection
from gpuvirt.errors import GpuvirtError, HostUnreachableError
from gpuvirt.tokens import read_token


class AdminRefusedError(GpuvirtError):
    """The host answered with an HTTP error: ``status`` 400 a bad value, 404 no such VF
    or endpoint, 409 not now (the VF's state forbids it), 502 the device backend
    failed, 500 a host bug; the message says which."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


class AdminClient:
    def __init__(
        self,
        address: Path | tuple[str, int],
        timeout: float = 30.0,
        token_file: Path | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.token_file = token_file  # read per request: the host may create it after us

    @classmethod
    def of(cls, host: HostSection, *, create: bool = True) -> AdminClient:
        """The client for a host's [host] section, with its bearer token if it has one."""
        return cls(host.admin_address(create=create), token_file=host.admin_token_file)

    def _headers(self) -> dict[str, str]:
        token = read_token(self.token_file) if self.token_file is not None else None
        return {"Authorization": f"Bearer {token.hex()}"} if token is not None else {}

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        if isinstance(self.address, Path):
            return _UnixConnection(self.address, timeout)
        return http.client.HTTPConnection(*self.address, timeout=timeout)

    def request(
        self, method: str, path: str, timeout: float | None = None, body: Any = None
    ) -> Any:
        """``body``, when given, goes as JSON."""
        raw, ctype = self.raw(method, path, timeout, body)
        return json.loads(raw) if ctype.startswith("application/json") else raw.decode()

    def raw(
        self, method: str, path: str, timeout: float | None = None, body: Any = None
    ) -> tuple[bytes, str]:
        conn = self._conn(timeout or self.timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"Content-Type": "application/json"}
        try:
            conn.request(method, path, data, {**headers, **self._headers()})
            resp = conn.getresponse()
            body = resp.read()
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise HostUnreachableError(
                f"no gpuvirt host at {self._where()} ({e.strerror}); start one with `gpuvirt host`"
                " or point --config at the host's configuration"
            ) from None
        except OSError as e:
            raise HostUnreachableError(f"admin endpoint {self._where()}: {e}") from None
        finally:
            conn.close()
        ctype = resp.getheader("Content-Type", "")
        if resp.status >= 400:
            try:
                msg = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                msg = body.decode(errors="replace")
            raise AdminRefusedError(msg, resp.status)
        return body, ctype

    def _where(self) -> str:
        return (
            str(self.address) if isinstance(self.address, Path) else "{}:{}".format(*self.address)
        )

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/status")

    def vf(self, index: int, action: str | None = None) -> dict[str, Any]:
        if action is None:
            return self.request("GET", f"/vf/{index}")
        return self.request("POST", f"/vf/{index}/{action}", timeout=120)

    def vf_set(
        self, index: int, fb: int | str | None = None, weight: float | None = None
    ) -> dict[str, Any]:
        """Reconfigure a VF (``POST /vf/N/set``): FB only while it has no guest, weight
        at any time; None leaves a value as it is. Returns the VF's status."""
        body = {k: v for k, v in (("fb", fb), ("weight", weight)) if v is not None}
        return self.request("POST", f"/vf/{index}/set", timeout=120, body=body)

    def events(
        self, after: int = 0, vf: int | None = None, wait: float = 0
    ) -> list[dict[str, Any]]:
        q = f"/events?after={after}&wait={wait}" + (f"&vf={vf}" if vf is not None else "")
        return self.request("GET", q, timeout=wait + 30)
