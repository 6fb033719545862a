"""`gpuvirt netgpu send|recv`: TCP streams into a VF's device memory, from the command line.

    gpuvirt netgpu recv --vf 1 --listen 0.0.0.0:9000 --streams 2 --verify
    gpuvirt netgpu send big.bin --to host:9000 --streams 2 --framed

`recv` attaches to the VF as its guest (socket and token from the host's
configuration) and serves: it listens until stopped (Ctrl-C, SIGTERM) or
until --streams N streams have ended, takes connections one after another
or several at once (--at-once), receives each into a pool in the VF's FB and
reports each stream as it ends (bytes, rate, with --verify its sha256
computed from the device memory the bytes landed in). A connection that
closes without a byte (a port probe, a health check) is reported and not
counted. `send` splits a file (or seeded synthetic bytes) into one
contiguous part per stream, stream i carrying part i.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from gpuvirt.cli.common import ConfigOpt, config_or_exit, console, err_console, fail
from gpuvirt.config import load_or_create_token, parse_size
from gpuvirt.errors import GpuvirtError

if TYPE_CHECKING:  # the guest side pulls in numpy; other commands should not pay for it
    from gpuvirt.netgpu import Pool, Rx

app = typer.Typer(
    help="NetGPU: receive TCP streams straight into a VF's device memory.",
    no_args_is_help=True,
)

Streams = Annotated[int, typer.Option(min=1, max=64, help="Parallel TCP streams.")]


def parse_addr(text: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) → (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise fail(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000", 2)
    return host, int(port)


def _size(text: str, what: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise fail(f"{what} {text!r}: {e}", 2) from None


def _rate(nbytes: int, seconds: float) -> str:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    size = f"{nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"
    return f"{size} in {seconds:.3f} s: {gbps:.3f} GB/s"


def _say(line: str) -> None:
    """One result line, never wrapped: scripts parse these."""
    console.print(line, soft_wrap=True)


@app.command()
def send(
    file: Annotated[Path | None, typer.Argument(help="File to send.", show_default=False)] = None,
    synthetic: Annotated[
        str | None,
        typer.Option(
            help="Send SIZE seeded synthetic bytes instead of a file.", show_default=False
        ),
    ] = None,
    to: Annotated[str, typer.Option(help="Receiver as HOST:PORT.", show_default=False)] = "",
    streams: Streams = 1,
    framed: Annotated[
        bool, typer.Option(help="NGPU-framed messages (default: raw bytes).")
    ] = False,
    crc: Annotated[bool, typer.Option(help="Framed: crc32 of each payload in its header.")] = False,
    message_size: Annotated[str, typer.Option(help="Framed: payload bytes per message.")] = "1MiB",
    seed: Annotated[int, typer.Option(help="Seed of --synthetic data.")] = 0,
) -> None:
    """Send a file or synthetic bytes over N streams, with a progress bar and the final rate."""
    from gpuvirt.netgpu.tx import FileSource, Source, SyntheticSource
    from gpuvirt.netgpu.tx import send as send_streams

    if (file is None) == (synthetic is None):
        raise fail("give a FILE or --synthetic SIZE (one of them)", 2)
    if not to:
        raise fail("--to HOST:PORT is required", 2)
    if crc and not framed:
        raise fail("--crc needs --framed: a raw stream has nowhere to carry a checksum", 2)
    addr = parse_addr(to)
    source: Source
    if file is not None:
        if not file.is_file():
            raise fail(f"{file}: no such file", 2)
        source = FileSource(file)
    else:
        source = SyntheticSource(_size(synthetic or "", "--synthetic"), seed)
    msg = _size(message_size, "--message-size")
    columns = (
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task(f"→ {to}", total=source.size)
        try:
            result = send_streams(
                addr, source, streams=streams, framed=framed, crc=crc, message_size=msg,
                progress=lambda n: progress.advance(task, n),
            )  # fmt: skip
        except ConnectionError as e:
            raise fail(str(e)) from None
    for i, why in sorted(result.errors.items()):
        err_console.print(f"[red]stream {i} failed:[/] {why}", soft_wrap=True)
    mode = "framed" if framed else "raw"
    _say(
        f"sent {_rate(result.bytes, result.seconds)} over {streams} {mode} "
        f"stream{'s' if streams > 1 else ''}"
    )
    if result.errors:
        raise typer.Exit(1)


@app.command()
def recv(
    vf: Annotated[int, typer.Option(help="The VF to receive into.", min=0, max=30)],
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (port 0: any free one).")],
    streams: Annotated[
        int, typer.Option(min=0, help="End after this many streams (0: serve until stopped).")
    ] = 0,
    at_once: Annotated[
        int, typer.Option(min=1, max=64, help="Streams received at the same time, at most.")
    ] = 8,
    raw: Annotated[bool, typer.Option(help="Every byte is payload (default: detect).")] = False,
    framed: Annotated[bool, typer.Option(help="Expect NGPU framing (default: detect).")] = False,
    crc: Annotated[bool, typer.Option(help="Require and check a crc32 on every message.")] = False,
    verify: Annotated[
        bool, typer.Option(help="Print each stream's sha256, read from the FB.")
    ] = False,
    pool: Annotated[str, typer.Option(help="Pool size in the VF's FB.")] = "64MiB",
    chunk: Annotated[str, typer.Option(help="Pool chunk size.")] = "1MiB",
    timeout: Annotated[
        float, typer.Option(help="A stream that sends nothing this many seconds fails.")
    ] = 60.0,
    coalesce_ms: Annotated[
        float,
        typer.Option(
            min=0,
            max=1000,
            help="Raw streams: a read waits up to this long for its chunk to fill (bulk "
            "transfers: one fragment per chunk); 0: every read is a fragment at once.",
        ),
    ] = 0.0,
    config: ConfigOpt = None,
) -> None:
    """Serve streams into a VF's FB; report each as it ends (and its sha256 with --verify)."""
    import gpuvirt

    if raw and framed:
        raise fail("--raw and --framed exclude each other", 2)
    mode = False if raw else (True if framed else None)
    addr = parse_addr(listen)
    cfg = config_or_exit(config)
    layout = cfg.vf_layout()
    if vf >= len(layout):
        raise fail(f"VF{vf}: this host has VFs 0..{len(layout) - 1}", 2)
    try:
        token = load_or_create_token(layout[vf].token_file)
        gpu = gpuvirt.attach(vf, socket=cfg.host.socket_path(create=False), token=token)
    except GpuvirtError as e:
        raise fail(str(e)) from None
    try:
        net = gpu.netgpu
        err_console.print(f"[dim]{net.selection().describe()}[/]")
        p = net.pool(nbytes=_size(pool, "--pool"), chunk=_size(chunk, "--chunk"))
        if at_once > p.nchunks:
            raise fail(f"--at-once {at_once}: a pool of {p.nchunks} chunks serves at most that", 2)
        try:
            listener = socket.create_server(addr, backlog=max(8, at_once))
        except OSError as e:
            raise fail(f"cannot listen on {addr[0]}:{addr[1]}: {e.strerror}") from None
        with listener:
            host, port = listener.getsockname()[:2]
            kind = {None: "raw or framed (detected)", False: "raw", True: "framed"}[mode]
            want = f"{streams} {kind} stream(s)" if streams else f"{kind} streams until stopped"
            _say(f"listening on {host}:{port} for {want}")
            server = _Server(p, listener, mode, crc, verify, streams, at_once, timeout, coalesce_ms)
            failed = server.serve()
    except GpuvirtError as e:
        raise fail(str(e)) from None
    finally:
        gpu.close()
    if failed:
        raise typer.Exit(1)


@dataclass
class _Tally:
    streams: int = 0
    bytes: int = 0
    failed: int = 0
    first: float | None = None
    last: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Server:
    """Accepts connections and receives each in its own thread, at most `at_once` at a time."""

    def __init__(self, pool: Pool, listener: socket.socket, mode: bool | None, crc: bool,
                 verify: bool, limit: int, at_once: int, timeout: float,
                 coalesce_ms: float) -> None:  # fmt: skip
        self.pool, self.listener, self.mode, self.crc = pool, listener, mode, crc
        self.verify, self.limit, self.at_once, self.timeout = verify, limit, at_once, timeout
        self.coalesce_ms = coalesce_ms
        self.slots = threading.BoundedSemaphore(at_once)
        self.tally = _Tally()
        self.live: set[Rx] = set()
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.stopping = False

    def serve(self) -> int:
        """Until stopped or `limit` streams ended; the number of streams that failed."""
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        threads: list[threading.Thread] = []
        accepted = 0
        try:
            while not self._done():
                if not self.slots.acquire(blocking=False):
                    self._wait(None)  # a stream's end frees a slot and writes the wake pipe
                    continue
                conn = self._accept()
                if conn is None:
                    self.slots.release()
                    continue
                t = threading.Thread(target=self._one, args=(conn, accepted), daemon=True)
                accepted += 1
                t.start()
                threads.append(t)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            for rx in list(self.live):
                rx.close()
            for t in threads:
                t.join()
            os.close(self.wake_r)
            os.close(self.wake_w)
        tl = self.tally
        seconds = tl.last - tl.first if tl.first is not None else 0.0
        _say(f"received {_rate(tl.bytes, seconds)} on {tl.streams} stream(s)")
        return tl.failed

    def _done(self) -> bool:
        return self.stopping or (self.limit > 0 and self.tally.streams >= self.limit)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"x")

    def _wait(self, listener: socket.socket | None) -> bool:
        """Until the listener is readable (True) or something woke us (False)."""
        fds = [self.wake_r] + ([listener.fileno()] if listener is not None else [])
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(fds, [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                return False
            return True
        return False

    def _accept(self) -> socket.socket | None:
        if not self._wait(self.listener):
            return None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        return conn

    def _one(self, conn: socket.socket, k: int) -> None:
        from gpuvirt.netgpu import RxError

        peer = _peer_name(conn)
        got: dict[int, int] = {}
        hashes: dict[int, Any] = {}
        errors: list[str] = []
        t0 = time.perf_counter()
        try:
            rx = self.pool.receive(conn, framed=self.mode, crc=True if self.crc else None,
                                   stream=k, timeout=self.timeout,
                                   coalesce_ms=self.coalesce_ms)  # fmt: skip
            # several streams share the pool: each may hold a message of its share only
            rx.max_message = min(
                rx.max_message, self.pool.nchunks // self.at_once * self.pool.chunk
            )
            self.live.add(rx)
            try:
                for frag in rx:
                    if self.verify:  # read where the bytes landed: the VF's FB
                        hashes.setdefault(frag.stream, hashlib.sha256()).update(frag.array())
                    got[frag.stream] = got.get(frag.stream, 0) + frag.size
                    self.pool.release([frag.token])
            finally:
                self.live.discard(rx)
        except RxError as e:
            errors = [str(s) for s in e.errors]
        except (TimeoutError, GpuvirtError) as e:
            errors = [str(e)]
        t1 = time.perf_counter()
        self._report(peer, got, hashes, errors, t0, t1)
        self.slots.release()
        self._poke()

    def _report(self, peer: str, got: dict[int, int], hashes: dict[int, Any],
                errors: list[str], t0: float, t1: float) -> None:  # fmt: skip
        tl = self.tally
        with tl.lock:
            if not got and not errors:
                err_console.print(
                    f"[dim]empty connection from {peer} (a port probe?): not counted[/]"
                )
                return
            tl.streams += 1
            tl.bytes += sum(got.values())
            tl.failed += bool(errors)
            tl.first = t0 if tl.first is None else min(tl.first, t0)
            tl.last = max(tl.last, t1)
            for stream in sorted(got):
                line = f"stream {stream}: {got[stream]} B"
                if self.verify:
                    line += f" sha256 {hashes[stream].hexdigest()}"
                _say(line)
                err_console.print(
                    f"[dim]stream {stream} from {peer}: {_rate(got[stream], t1 - t0)}[/]"
                )
            for why in errors:
                err_console.print(f"[red]failed:[/] {why}", soft_wrap=True)


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "?"
    return f"{host}:{port}"
