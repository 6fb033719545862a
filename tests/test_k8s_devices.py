"""devices.py without gRPC: health, preferred allocations, what Allocate may mount."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s import devices as dev

STATES = [
    "UNAVAIL",
    "AVAIL",
    "FULLACCESS",
    "ACTIVE",
    "SUSPEND",
    "RESETTING",
    "QUARANTINED",
    "FAILED",
]


def status(vfs: list[dict], socket_path: str = "/run/gpuvirt/host.sock") -> dict:
    return {"socket": socket_path, "pid": 1, "vfs": vfs}


def vf(
    i: int, state: str = "AVAIL", fb: int = 1 << 28, guest: int | None = None, token: str = ""
) -> dict:
    return {"index": i, "state": state, "fb_total": fb, "guest_pid": guest, "token_file": token}


@pytest.mark.parametrize("state", STATES)
def test_health_follows_the_vf_state(state: str) -> None:
    view = dev.host_view(status([vf(0, state), vf(1)]))
    want = "Unhealthy" if state in ("UNAVAIL", "RESETTING", "QUARANTINED", "FAILED") else "Healthy"
    assert view.health() == {"vf0": want, "vf1": "Healthy"}
    assert view.gone().health() == {"vf0": "Unhealthy", "vf1": "Unhealthy"}
    assert view.with_state(0, "AVAIL").health() == {"vf0": "Healthy", "vf1": "Healthy"}


def test_before_the_host_answers_every_configured_vf_is_listed_unhealthy() -> None:
    assert dev.initial_view(3).health() == dict.fromkeys(("vf0", "vf1", "vf2"), "Unhealthy")


@pytest.mark.parametrize(
    "bad", [{}, {"vfs": [{"index": 0}]}, {"vfs": "x", "socket": "s", "pid": 1}]
)
def test_a_status_without_what_is_needed_is_refused_by_name(bad: dict) -> None:
    with pytest.raises(GpuvirtError, match="lacks what the device plugin needs"):
        dev.host_view(bad)


@given(st.integers(0, 99))
def test_device_ids_round_trip(i: int) -> None:
    assert dev.vf_index(dev.device_id(i)) == i


@given(st.text(max_size=8).filter(lambda t: not (t.startswith("vf") and t[2:].isdigit())))
def test_other_ids_are_refused(text: str) -> None:
    with pytest.raises(dev.AllocateError, match="not one of this plugin's"):
        dev.vf_index(text)


vf_lists = st.lists(
    st.tuples(st.sampled_from(STATES), st.integers(1, 8), st.booleans()), min_size=1, max_size=8
)


@given(vf_lists, st.data())
def test_preferred_is_a_valid_choice_with_free_and_large_vfs_first(vfs, data) -> None:
    view = dev.host_view(
        status([vf(i, s, fb << 20, 7 if g else None) for i, (s, fb, g) in enumerate(vfs)])
    )
    ids = [dev.device_id(i) for i in range(len(vfs))]
    available = data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1))
    must = data.draw(st.lists(st.sampled_from(available), unique=True))
    size = data.draw(st.integers(len(must), len(available)))
    got = dev.preferred(view, available, must, size)
    assert len(got) == size and len(set(got)) == size
    assert set(must) <= set(got) <= set(available)
    assert got[: len(must)] == must
    by_id = {dev.device_id(v.index): v for v in view.vfs}
    rank = [(by_id[d].has_guest, -by_id[d].fb, by_id[d].index) for d in got[len(must) :]]
    assert rank == sorted(rank)
    left = [d for d in available if d not in got]
    if rank and left:  # nothing left out ranks above what was chosen
        worst = rank[-1]
        assert all((by_id[d].has_guest, -by_id[d].fb, by_id[d].index) >= worst for d in left)


def _listen(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return s


def test_allocate_mounts_the_socket_directory_only_when_it_holds_nothing_else(
    tmp_path: Path,
) -> None:
    (tmp_path / "mailbox").mkdir()
    sock = _listen(tmp_path / "mailbox" / "host.sock")
    token = tmp_path / "vf3.token"
    token.write_text("0" * 64)
    view = dev.host_view(status([vf(3, token=str(token))], str(tmp_path / "mailbox" / "host.sock")))
    a = dev.allocate(view, ["vf3"])
    assert a.mounts[0] == dev.MountSpec("/run/gpuvirt/mailbox", str(tmp_path / "mailbox"), True)
    assert a.mounts[1] == dev.MountSpec("/run/gpuvirt/tokens/vf3.token", str(token), True)
    (tmp_path / "mailbox" / "admin.sock").touch()
    a = dev.allocate(view, ["vf3"])
    assert a.mounts[0] == dev.MountSpec(
        "/run/gpuvirt/mailbox/host.sock", str(tmp_path / "mailbox" / "host.sock"), True
    )
    sock.close()


def test_allocate_gives_every_vf_of_a_container_and_names_the_first(tmp_path: Path) -> None:
    sock = _listen(tmp_path / "host.sock")
    tokens = []
    for i in (1, 4):
        tokens.append(tmp_path / "t" / f"{i}")
        tokens[-1].parent.mkdir(exist_ok=True)
        tokens[-1].write_text("0" * 64)
    view = dev.host_view(
        status(
            [vf(1, token=str(tokens[0])), vf(4, token=str(tokens[1]))], str(tmp_path / "host.sock")
        )
    )
    a = dev.allocate(view, ["vf4", "vf1"])
    assert a.envs["GPUVIRT_VF"] == "1" and a.envs["GPUVIRT_VFS"] == "1,4"
    assert a.envs["GPUVIRT_TOKEN_FILE"] == "/run/gpuvirt/tokens/vf1.token"
    assert [m.container_path for m in a.mounts[1:]] == [
        "/run/gpuvirt/tokens/vf1.token",
        "/run/gpuvirt/tokens/vf4.token",
    ]
    sock.close()


def test_allocate_refuses_a_missing_token_or_socket(tmp_path: Path) -> None:
    (tmp_path / "other").touch()
    view = dev.host_view(status([vf(0, token=str(tmp_path / "nope"))], str(tmp_path / "host.sock")))
    with pytest.raises(dev.AllocateError, match=r"mailbox socket .*host\.sock: No such file"):
        dev.allocate(view, ["vf0"])
    sock = _listen(tmp_path / "host.sock")
    with pytest.raises(dev.AllocateError, match=r"VF0: token file .*nope: No such file"):
        dev.allocate(view, ["vf0"])
    (tmp_path / "nope").mkdir()
    with pytest.raises(dev.AllocateError, match="is not a regular file"):
        dev.allocate(view, ["vf0"])
    with pytest.raises(dev.AllocateError, match="no devices"):
        dev.allocate(view, [])
    with pytest.raises(dev.AllocateError, match="has not been reachable yet"):
        dev.allocate(dev.initial_view(1), ["vf0"])
    sock.close()


def test_attach_takes_the_token_from_gpuvirt_token_file(tmp_path: Path, monkeypatch) -> None:
    import gpuvirt
    from gpuvirt.errors import HostUnreachableError

    monkeypatch.setenv("GPUVIRT_SOCKET", str(tmp_path / "nobody.sock"))
    monkeypatch.setenv("GPUVIRT_VF", "0")
    monkeypatch.delenv("GPUVIRT_TOKEN", raising=False)
    monkeypatch.delenv("GPUVIRT_TOKEN_FILE", raising=False)
    with pytest.raises(GpuvirtError, match="set GPUVIRT_TOKEN or GPUVIRT_TOKEN_FILE"):
        gpuvirt.attach()
    token = tmp_path / "vf0.token"
    monkeypatch.setenv("GPUVIRT_TOKEN_FILE", str(token))
    with pytest.raises(GpuvirtError, match=r"GPUVIRT_TOKEN_FILE='.*vf0\.token': cannot read it"):
        gpuvirt.attach()
    token.write_text("not a token\n")
    with pytest.raises(GpuvirtError, match=r"vf0\.token': a token must be .* 64 hex"):
        gpuvirt.attach()
    token.write_text("ab" * 32 + "\n")
    with pytest.raises(HostUnreachableError):  # the token was taken; there is no host
        gpuvirt.attach()
