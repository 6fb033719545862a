"""`gpuvirt netgpu send|recv`: TCP streams into a VF's device memory, from the command line.

    gpuvirt netgpu recv --vf 1 --listen 0.0.0.0:9000 --streams 2 --verify
    gpuvirt netgpu send big.bin --to host:9000 --streams 2 --framed

`recv` attaches to the VF as its guest (socket and token from the host's
configuration), receives into a pool in the VF's FB and prints the rate;
with --verify, each stream's sha256 computed from the device memory the
bytes landed in. `send` splits a file (or seeded synthetic bytes) into one
contiguous part per stream, stream i carrying part i.
"""

from __future__ import annotations

import hashlib
import time
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
    streams: Streams = 1,
    raw: Annotated[bool, typer.Option(help="Every byte is payload (default: detect).")] = False,
    framed: Annotated[bool, typer.Option(help="Expect NGPU framing (default: detect).")] = False,
    crc: Annotated[bool, typer.Option(help="Require and check a crc32 on every message.")] = False,
    verify: Annotated[
        bool, typer.Option(help="Print each stream's sha256, read from the FB.")
    ] = False,
    pool: Annotated[str, typer.Option(help="Pool size in the VF's FB.")] = "64MiB",
    chunk: Annotated[str, typer.Option(help="Pool chunk size.")] = "1MiB",
    timeout: Annotated[float, typer.Option(help="Give up after this many idle seconds.")] = 60.0,
    config: ConfigOpt = None,
) -> None:
    """Receive streams into a VF's FB; print the rate (and each sha256 with --verify)."""
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
        rx = p.listen(
            addr, streams=streams, framed=mode, crc=True if crc else None, timeout=timeout
        )
        assert rx.address is not None
        kind = {None: "raw or framed (detected)", False: "raw", True: "framed"}[mode]
        _say(f"listening on {rx.address[0]}:{rx.address[1]} for {streams} {kind} stream(s)")
        _receive(rx, p, verify)
    except GpuvirtError as e:
        raise fail(str(e)) from None
    except TimeoutError as e:
        raise fail(str(e)) from None
    finally:
        gpu.close()


def _receive(rx: Rx, pool: Pool, verify: bool) -> None:
    from gpuvirt.netgpu import RxError

    got: dict[int, int] = {}
    hashes: dict[int, Any] = {}
    t0: float | None = None
    errors: list[str] = []
    try:
        for frag in rx:
            if t0 is None:
                t0 = time.perf_counter() - 1e-9
            if verify:  # read where the bytes landed: the VF's FB
                hashes.setdefault(frag.stream, hashlib.sha256()).update(frag.array())
            got[frag.stream] = got.get(frag.stream, 0) + frag.size
            pool.release([frag.token])
    except RxError as e:
        errors = [str(s) for s in e.errors]
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    for stream in sorted(got):
        line = f"stream {stream}: {got[stream]} B"
        if verify:
            line += f" sha256 {hashes[stream].hexdigest()}"
        _say(line)
    for why in errors:
        err_console.print(f"[red]failed:[/] {why}", soft_wrap=True)
    _say(f"received {_rate(sum(got.values()), seconds)} on {len(got)} stream(s)")
    if errors:
        raise typer.Exit(1)
