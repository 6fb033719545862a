"""State (prepared claims) against a real host, without gRPC: a prepare that fails half
way is undone, and one interrupted by a crash (left PREPARING in the checkpoint) is
finished or undone by the next plugin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dra_env import claim
from gpuvirt.config import MiB
from gpuvirt.k8s.dra.checkpoint import Checkpoint, ClaimEntry, Phase, PreparedDevice
from gpuvirt.k8s.dra.params import ClaimError
from gpuvirt.k8s.dra.state import ClaimRef, State
from helpers import MakeHost

HOST = {"sriov": {"vf_num": 2}, "vf": [{"index": 0, "fb": "32MiB"}, {"index": 1, "fb": "32MiB"}]}


def _state(hp: Any, tmp_path: Path, claims: dict[str, dict[str, Any]], cdi_dir: Path) -> State:
    def read(namespace: str, name: str) -> dict[str, Any]:
        return claims[name]

    return State("n1", hp.admin, read, Checkpoint(tmp_path / "ck.json").load(), cdi_dir)


def _ref(c: dict[str, Any]) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def test_a_prepare_that_fails_half_way_puts_the_vf_back(
    make_host: MakeHost, tmp_path: Path
) -> None:
    hp = make_host(**HOST)
    not_a_dir = tmp_path / "cdi"
    not_a_dir.write_text("a file where the CDI directory should be")
    c = claim("n1", ["vf0"], {"fb": "64MiB", "weight": 4})
    st = _state(hp, tmp_path, {c["metadata"]["name"]: c}, not_a_dir)
    with pytest.raises(ClaimError, match=f"claim default/{c['metadata']['name']}: .*cdi"):
        st.prepare(_ref(c))
    vf = hp.admin.vf(0)
    assert (vf["fb_total"], vf["weight"], vf["state"]) == (32 * MiB, 1, "AVAIL")
    assert Checkpoint(tmp_path / "ck.json").load().claims == {}


def _crashed(tmp_path: Path, c: dict[str, Any], hp: Any) -> None:
    """The checkpoint a plugin leaves when it dies after `vf set` and before its CDI spec."""
    ck = Checkpoint(tmp_path / "ck.json")
    m = c["metadata"]
    dev = PreparedDevice(
        "vf", "n1", "vf0", 0, [f"gpuvirt.io/vf={m['uid']}-vf0"], {"fb": 32 * MiB, "weight": 1.0}
    )
    ck.claims[m["uid"]] = ClaimEntry(m["namespace"], m["name"], Phase.PREPARING, [dev])
    ck.save()
    hp.admin.vf_set(0, weight=7, fb="48MiB")


def test_an_interrupted_prepare_is_done_again_from_the_start(
    make_host: MakeHost, tmp_path: Path
) -> None:
    hp = make_host(**HOST)
    c = claim("n1", ["vf0"], {"weight": 2})
    _crashed(tmp_path, c, hp)
    st = _state(hp, tmp_path, {c["metadata"]["name"]: c}, tmp_path / "cdi")
    [dev] = st.prepare(_ref(c))
    vf = hp.admin.vf(0)
    # The claim asked only for weight 2: the FB the crashed attempt changed went back.
    assert (vf["fb_total"], vf["weight"]) == (32 * MiB, 2)
    assert dev.previous == {"fb": 32 * MiB, "weight": 1.0}
    assert (
        Checkpoint(tmp_path / "ck.json").load().claims[c["metadata"]["uid"]].phase == Phase.PREPARED
    )


def test_an_interrupted_prepare_is_undone_by_unprepare(make_host: MakeHost, tmp_path: Path) -> None:
    hp = make_host(**HOST)
    c = claim("n1", ["vf0"], {"weight": 2})
    _crashed(tmp_path, c, hp)
    st = _state(hp, tmp_path, {}, tmp_path / "cdi")  # the claim is gone from the API too
    st.unprepare(_ref(c))
    vf = hp.admin.vf(0)
    assert (vf["fb_total"], vf["weight"], vf["state"]) == (32 * MiB, 1, "AVAIL")
    assert Checkpoint(tmp_path / "ck.json").load().claims == {}


def test_unprepare_detaches_a_guest_still_attached(make_host: MakeHost, tmp_path: Path) -> None:
    import numpy as np

    import gpuvirt

    hp = make_host(**HOST)
    c = claim("n1", ["vf1"], {"fb": "64MiB", "weight": 2})
    st = _state(hp, tmp_path, {c["metadata"]["name"]: c}, tmp_path / "cdi")
    st.prepare(_ref(c))
    # A container the runtime has not stopped yet: its guest still holds the VF.
    gpu = gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1))
    try:
        x = gpu.alloc((1024,), np.float32)
        x.write(np.full(1024, 7, np.float32))
        assert hp.admin.vf(1)["state"] in ("ACTIVE", "SUSPEND")
        st.unprepare(_ref(c))
        vf = hp.admin.vf(1)
        assert (vf["state"], vf["guest_pid"], vf["fb_total"], vf["weight"]) == (
            "AVAIL", None, 32 * MiB, 1,
        )  # fmt: skip
        with pytest.raises(gpuvirt.GpuvirtError):
            x.read()
    finally:
        gpu.close()
    # The next tenant of VF1 finds nothing of the last one's data.
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as nxt:
        y = nxt.alloc((1024,), np.float32)
        assert not y.read().any()
