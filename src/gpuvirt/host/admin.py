"""The admin endpoint: a small HTTP/1.1 server on a Unix socket or TCP port.

    GET  /status                 the device and every VF (JSON)
    GET  /vf/N                   one VF (JSON)
    GET  /sched?latencies=1      scheduler counters (and every world-switch latency, ns)
    POST /vf/N/ACTION            enable | disable | reset | clear-fb | clear-guard
    POST /vf/N/set               JSON {"fb": "4GiB" | bytes, "weight": W}, either optional
    GET  /events?after=&vf=&wait= events newer than `after` (long-poll up to `wait` s)
    GET  /metrics                Prometheus text format

One request per connection (Connection: close): the clients are the CLI, curl
and a Prometheus scraper, none of which needs more.

Who may call: on a Unix socket, whoever the socket's mode lets connect; on TCP,
the address must be loopback unless `host.admin_token_file` is set, and with a
token every TCP request needs `Authorization: Bearer <token>` (else 401). Every
mutating call is an event naming its caller (uid from SO_PEERCRED on the Unix
socket, the peer address on TCP). Long-polls (`/events?wait=`) wait on the loop
and hold no thread, so they never delay the FLRs that the executor runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import os
import socket
import struct
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from gpuvirt.config import VFSettings, parse_vf_settings
from gpuvirt.defaults import ADMIN_MAX_CLIENTS as MAX_CLIENTS
from gpuvirt.defaults import ADMIN_MAX_REQUEST as MAX_REQUEST
from gpuvirt.defaults import ADMIN_MAX_WAIT_S as MAX_WAIT_S
from gpuvirt.errors import ConfigError, DeviceError, StateConflictError
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.vfmgr import VF

ACTIONS = ("enable", "disable", "reset", "clear-fb", "clear-guard")
# The answer to a failed request follows from its error's class (gpuvirt/errors.py);
# any other exception, StateError included, is a host bug: 500, and a `bug` event.
ERROR_STATUS = (
    (ConfigError, HTTPStatus.BAD_REQUEST),  # a value refused: the same request fails again
    (StateConflictError, HTTPStatus.CONFLICT),  # not now: the VF's state forbids it
    (DeviceError, HTTPStatus.BAD_GATEWAY),  # the device backend failed a valid request
)


class AdminHost(Protocol):
    """Everything the admin endpoint may touch on the host."""

    events: EventLog

    def status(self) -> dict[str, Any]: ...
    def sched_view(self, latencies: bool) -> dict[str, Any]: ...
    def metrics(self) -> tuple[bytes, str]: ...
    def find_vf(self, index: int) -> VF | None: ...
    def vf_count(self) -> int: ...
    def vf_status(self, vf: VF) -> dict[str, Any]: ...
    async def enable(self, vf: VF) -> None: ...
    async def disable(self, vf: VF) -> None: ...
    async def reset_vf(self, vf: VF, reason: str) -> None: ...
    async def clear_fb(self, vf: VF) -> None: ...
    async def clear_guard(self, vf: VF) -> None: ...
    async def set_vf(self, vf: VF, settings: VFSettings, caller: str) -> None: ...


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminServer:
    def __init__(
        self, host: AdminHost, address: Path | tuple[str, int], token: bytes | None
    ) -> None:
        self.host = host
        self.address = address
        self.where = (
            str(self.address) if isinstance(self.address, Path) else "{}:{}".format(*self.address)
        )
        # Bearer tokens are the hex of the token file's secret, like the VF tokens.
        self._token = token.hex().encode() if token is not None else None
        self._clients = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if isinstance(self.address, Path):
            self.address.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.address.unlink()
            self._server = await asyncio.start_unix_server(self._client, str(self.address))
            os.chmod(self.address, 0o660)
        else:
            self._server = await asyncio.start_server(self._client, *self.address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if isinstance(self.address, Path):
            with contextlib.suppress(FileNotFoundError):
                self.address.unlink()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            except (
                asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                TimeoutError,
            ):  # fmt: skip
                writer.close()  # the caller went away or never sent a whole request
                return
            if self._clients > MAX_CLIENTS:
                raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "too many admin requests at once")
            status, ctype, body = await self._request(head, reader, caller(writer))
        except Exception as e:
            status, ctype, body = status_of(e), "application/json", _json({"error": str(e)})
            if status is HTTPStatus.INTERNAL_SERVER_ERROR:  # a host bug: an event too
                self.host.events.emit(Category.HOST, "bug", f"admin request failed: {e!r}", None)
                body = _json({"error": f"internal error: {e!r}"})
        finally:
            self._clients -= 1
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    async def _request(
        self, head: bytes, reader: asyncio.StreamReader, who: dict[str, Any]
    ) -> tuple[HTTPStatus, str, bytes]:
        if len(head) > MAX_REQUEST:
            raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request too large")
        lines = head.split(b"\r\n")
        try:
            method, target, _version = lines[0].decode("ascii").split(" ")
        except (UnicodeDecodeError, ValueError):
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line") from None
        if self._token is not None and "address" in who:
            self._authenticate(lines[1:])
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        if method == "GET" and parts == ["metrics"]:
            data, ctype = self.host.metrics()
            return HTTPStatus.OK, ctype, data
        body = await _read_body(reader, head)
        result = await self._route(method, parts, query, who, body)
        return HTTPStatus.OK, "application/json", _json(result)

    def _authenticate(self, headers: list[bytes]) -> None:
        assert self._token is not None
        for line in headers:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                scheme, _, given = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token):
                    return
                break
        raise HttpError(
            HTTPStatus.UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <the hex in "
            "host.admin_token_file>)",
        )

    async def _route(
        self,
        method: str,
        parts: list[str],
        query: dict[str, str],
        who: dict[str, Any],
        body: bytes = b"",
    ) -> Any:
        host = self.host
        if method == "GET" and parts == ["status"]:
            return host.status()
        if method == "GET" and parts == ["sched"]:
            return host.sched_view(bool(query.get("latencies")))
        if method == "GET" and parts == ["events"]:
            after = _int(query, "after", 0)
            vf = _int(query, "vf", None)
            wait = _wait(query)
            if wait > 0 and host.events.last_seq <= after:
                await host.events.wait_async(after, wait)
            return [asdict(e) for e in host.events.since(after, vf, _int(query, "limit", 1000))]
        if len(parts) >= 2 and parts[0] == "vf":
            vf = self._vf(parts[1])
            if method == "GET" and len(parts) == 2:
                return host.vf_status(vf)
            if method == "POST" and parts[2:] == ["set"]:
                return await self._set(vf, body, who)
            if method == "POST" and len(parts) == 3:
                return await self._action(vf, parts[2], who)
        raise HttpError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} /{'/'.join(parts)}")

    def _vf(self, text: str) -> VF:
        vf = self.host.find_vf(int(text)) if text.isascii() and text.isdigit() else None
        if vf is None:
            raise HttpError(
                HTTPStatus.NOT_FOUND,
                f"no VF {text!r}: this host has VFs 0..{self.host.vf_count() - 1}",
            )
        return vf

    async def _action(self, vf: VF, action: str, who: dict[str, Any]) -> Any:
        host = self.host
        if action not in ACTIONS:
            raise HttpError(
                HTTPStatus.NOT_FOUND, f"unknown action {action!r}; one of {', '.join(ACTIONS)}"
            )
        host.events.emit(
            Category.ADMIN, action, f"admin ({_by(who)}): {action} VF{vf.index}", vf.index,
            caller=who,
        )  # fmt: skip
        if action == "enable":
            await host.enable(vf)
        elif action == "disable":
            await host.disable(vf)
        elif action == "reset":
            await host.reset_vf(vf, "admin")
        elif action == "clear-fb":
            await host.clear_fb(vf)
        else:
            await host.clear_guard(vf)
        return host.vf_status(vf)

    async def _set(self, vf: VF, body: bytes, who: dict[str, Any]) -> Any:
        where = f"POST /vf/{vf.index}/set"
        try:
            data = json.loads(body or b"{}")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            raise HttpError(HTTPStatus.BAD_REQUEST, f"{where}: the body is not JSON: {e}") from None
        await self.host.set_vf(vf, parse_vf_settings(data, where), f"admin ({_by(who)})")
        return self.host.vf_status(vf)


def status_of(e: Exception) -> HTTPStatus:
    """The HTTP status of a failed request, by what its error means."""
    if isinstance(e, HttpError):
        return e.status
    for cls, status in ERROR_STATUS:
        if isinstance(e, cls):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The request body, as long as Content-Length says (no chunked encoding)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        if name == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_REQUEST:
                raise HttpError(
                    HTTPStatus.BAD_REQUEST,
                    f"Content-Length {value.strip().decode(errors='replace')!r}: "
                    f"must be 0..{MAX_REQUEST}",
                )
    return await asyncio.wait_for(reader.readexactly(length), 10) if length else b""


def _json(obj: Any) -> bytes:
    return json.dumps(obj, default=str).encode()


def _by(who: dict[str, Any]) -> str:
    return f"uid {who['uid']}" if "uid" in who else who.get("address", "?")


def caller(writer: asyncio.StreamWriter) -> dict[str, Any]:
    """Who is calling: uid/pid from SO_PEERCRED on a Unix socket, the address on TCP."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        pid, uid, gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        return {"uid": uid, "gid": gid, "pid": pid}
    peer = writer.get_extra_info("peername")
    return {"address": f"{peer[0]}:{peer[1]}" if peer else "?"}


def _wait(query: dict[str, str]) -> float:
    text = query.get("wait", "0") or "0"
    try:
        wait = float(text)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait) or wait < 0:
        raise HttpError(
            HTTPStatus.BAD_REQUEST, f"wait={text!r}: must be a number of seconds, 0 or more"
        )
    return min(wait, MAX_WAIT_S)


def _int(query: dict[str, str], key: str, default: int | None) -> Any:
    if key not in query:
        return default
    try:
        return int(query[key])
    except ValueError:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{key}={query[key]!r}: not an integer") from None
