"""`gpuvirt netgpu send|recv` as a user runs them: two processes, a real host, loopback TCP."""

from __future__ import annotations

import hashlib
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuvirt.bench.common import scratch_host
from gpuvirt.host.process import HostProcess

pytestmark = pytest.mark.timeout(60)
NETGPU = [sys.executable, "-c", "from gpuvirt.cli.netgpu import app; app()"]
WAIT_S = 30


@pytest.fixture(scope="module")
def host() -> Iterator[HostProcess]:
    with scratch_host(sriov={"vf_num": 1}) as hp:
        yield hp


def start_recv(hp: HostProcess, *args: str) -> tuple[subprocess.Popen[str], str]:
    argv = ["recv", "--vf", "0", "--listen", "127.0.0.1:0", "--config", str(hp.config_path)]
    p = subprocess.Popen([*NETGPU, *argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()  # the receiver says where it listens once it does
    if not line.startswith("listening on "):
        p.kill()
        raise AssertionError(f"recv did not start: {line!r} {p.stderr.read() if p.stderr else ''}")
    return p, line.split()[2]


def send(to: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NETGPU, "send", "--to", to, *args], capture_output=True, text=True, timeout=WAIT_S
    )


def stream_hashes(out: str) -> dict[int, tuple[int, str]]:
    found = re.findall(r"^stream (\d+): (\d+) B sha256 ([0-9a-f]{64})$", out, re.M)
    return {int(s): (int(n), h) for s, n, h in found}


def parts(data: bytes, streams: int) -> list[bytes]:
    """How the sender splits its data: contiguous parts, stream i carrying part i."""
    n = len(data)
    return [data[i * n // streams : (i + 1) * n // streams] for i in range(streams)]


def test_send_a_file_framed_and_verify_it_from_device_memory(
    host: HostProcess, tmp_path: Path
) -> None:
    data = np.random.default_rng(21).bytes(3 * 1024 * 1024 + 777)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    recv, to = start_recv(host, "--streams", "2", "--verify")
    sent = send(to, str(path), "--streams", "2", "--framed", "--message-size", "256KiB")
    out, err = recv.communicate(timeout=WAIT_S)
    assert sent.returncode == 0, sent.stderr
    assert re.search(r"sent 3\.00 MiB in [\d.]+ s: [\d.]+ GB/s over 2 framed streams", sent.stdout)
    assert recv.returncode == 0, err
    want = {i: (len(p), hashlib.sha256(p).hexdigest()) for i, p in enumerate(parts(data, 2))}
    assert stream_hashes(out) == want
    assert re.search(r"received [\d.]+ MiB in [\d.]+ s: [\d.]+ GB/s on 2 stream\(s\)", out)


def test_send_synthetic_raw_and_verify(host: HostProcess) -> None:
    size, seed = 2 * 1024 * 1024 + 5, 17
    # the documented synthetic data: 1 MiB blocks of numpy's default_rng([seed, k]), cut to size
    blocks = [np.random.default_rng([seed, k]).bytes(1 << 20) for k in range(3)]
    data = b"".join(blocks)[:size]
    recv, to = start_recv(host, "--raw", "--verify", "--streams", "1")
    sent = send(to, "--synthetic", str(size), "--seed", str(seed))
    out, err = recv.communicate(timeout=WAIT_S)
    assert sent.returncode == 0 and recv.returncode == 0, sent.stderr + err
    assert stream_hashes(out) == {0: (size, hashlib.sha256(data).hexdigest())}


def test_a_stream_that_is_not_framed_fails_with_the_reason(host: HostProcess) -> None:
    recv, to = start_recv(host, "--framed", "--streams", "1")
    sent = send(to, "--synthetic", "64KiB")
    _, err = recv.communicate(timeout=WAIT_S)
    assert recv.returncode == 1
    assert "NGPU magic" in err and "not a framed-mode stream" in err
    assert sent.returncode == 1 and "stream 0 failed" in sent.stderr


def test_recv_serves_streams_one_after_another_and_a_port_probe_does_not_end_it(
    host: HostProcess,
) -> None:
    recv, to = start_recv(host, "--raw", "--verify", "--streams", "2")
    h, port = to.rsplit(":", 1)
    socket.create_connection((h, int(port))).close()  # a port probe: connects, sends nothing
    first = send(to, "--synthetic", "300KiB", "--seed", "1")
    second = send(to, "--synthetic", "200KiB", "--seed", "2")
    out, err = recv.communicate(timeout=WAIT_S)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert recv.returncode == 0, err
    assert "empty connection from" in err
    got = stream_hashes(out)
    assert sorted(n for n, _ in got.values()) == [200 * 1024, 300 * 1024]
    assert re.search(r"on 2 stream\(s\)", out)


def test_recv_without_a_stream_count_serves_until_stopped(host: HostProcess) -> None:
    recv, to = start_recv(host, "--raw")
    for seed in (1, 2, 3):
        assert send(to, "--synthetic", "64KiB", "--seed", str(seed)).returncode == 0
    recv.send_signal(signal.SIGTERM)
    out, err = recv.communicate(timeout=WAIT_S)
    assert recv.returncode == 0, err
    assert re.search(r"received [\d.]+ \w+ in [\d.]+ s: [\d.]+ GB/s on 3 stream\(s\)", out)
