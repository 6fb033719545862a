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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from gpuvirt.config import parse_vf_settings
from gpuvirt.errors import ConfigError, GpuvirtError
from gpuvirt.host.events import Category
from gpuvirt.host.reconfig import set_vf

if TYPE_CHECKING:
    from gpuvirt.host.daemon import Host

MAX_REQUEST = 16 * 1024
ACTIONS = ("enable", "disable", "reset", "clear-fb", "clear-guard")


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminServer:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.address = host.admin_address
        self.where = (
            str(self.address) if isinstance(self.address, Path) else "{}:{}".format(*self.address)
        )
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
        try:
            status, ctype, body = await self._request(reader)
        except HttpError as e:
            status, ctype, body = e.status, "application/json", _json({"error": str(e)})
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    async def _request(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, str, bytes]:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if len(head) > MAX_REQUEST:
            raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request too large")
        try:
            method, target, _version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
        except (UnicodeDecodeError, ValueError):
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line") from None
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        if method == "GET" and parts == ["metrics"]:
            from gpuvirt.host.metrics import render

            data, ctype = render(self.host)
            return HTTPStatus.OK, ctype, data
        body = await _read_body(reader, head)
        result = await self._route(method, parts, query, body)
        return HTTPStatus.OK, "application/json", _json(result)

    async def _route(
        self, method: str, parts: list[str], query: dict[str, str], body: bytes = b""
    ) -> Any:
        host = self.host
        if method == "GET" and parts == ["status"]:
            return host.status()
        if method == "GET" and parts == ["sched"]:
            snap = host.sched.snapshot()
            if query.get("latencies"):
                snap["latencies_ns"] = list(host.sched.stats.latencies_ns)
                snap["commands_ns"] = {k: list(v) for k, v in host.sched.stats.commands_ns.items()}
            return snap
        if method == "GET" and parts == ["events"]:
            after = _int(query, "after", 0)
            vf = _int(query, "vf", None)
            wait = min(float(query.get("wait", 0) or 0), 30.0)
            if wait > 0 and host.events.last_seq <= after:
                await asyncio.to_thread(host.events.wait, after, wait)
            return [asdict(e) for e in host.events.since(after, vf, _int(query, "limit", 1000))]
        if len(parts) >= 2 and parts[0] == "vf":
            vf = self._vf(parts[1])
            if method == "GET" and len(parts) == 2:
                return host.vf_status(vf)
            if method == "POST" and parts[2:] == ["set"]:
                return await self._set(vf, body)
            if method == "POST" and len(parts) == 3:
                return await self._action(vf, parts[2])
        raise HttpError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} /{'/'.join(parts)}")

    def _vf(self, text: str):
        try:
            index = int(text)
            return self.host.vfm[index]
        except (ValueError, IndexError):
            raise HttpError(
                HTTPStatus.NOT_FOUND,
                f"no VF {text!r}: this host has VFs 0..{len(self.host.vfm) - 1}",
            ) from None

    async def _action(self, vf: Any, action: str) -> Any:
        host = self.host
        if action not in ACTIONS:
            raise HttpError(
                HTTPStatus.NOT_FOUND, f"unknown action {action!r}; one of {', '.join(ACTIONS)}"
            )
        host.events.emit(Category.ADMIN, action, f"admin: {action} VF{vf.index}", vf.index)
        try:
            if action == "enable":
                await host.enable(vf)
            elif action == "disable":
                await host.disable(vf)
            elif action == "reset":
                await host.resetter.flr(vf, "admin")
            elif action == "clear-fb":
                await host.clear_fb(vf)
            else:
                await host.clear_guard(vf)
        except GpuvirtError as e:
            raise HttpError(HTTPStatus.CONFLICT, str(e)) from None
        return host.vf_status(vf)

    async def _set(self, vf: Any, body: bytes) -> Any:
        where = f"POST /vf/{vf.index}/set"
        try:
            data = json.loads(body or b"{}")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            raise HttpError(HTTPStatus.BAD_REQUEST, f"{where}: the body is not JSON: {e}") from None
        try:
            await set_vf(self.host, vf, parse_vf_settings(data, where))
        except ConfigError as e:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(e)) from None
        except GpuvirtError as e:
            raise HttpError(HTTPStatus.CONFLICT, str(e)) from None
        return self.host.vf_status(vf)


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


def _int(query: dict[str, str], key: str, default: int | None) -> Any:
    if key not in query:
        return default
    try:
        return int(query[key])
    except ValueError:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"{key}={query[key]!r}: not an integer") from None
