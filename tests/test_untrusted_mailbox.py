"""Hostile peers on the mailbox: each limit of DESIGN.md's "Untrusted inputs", tried for real.

Every test runs a real host and attacks it over its real socket with a peer
that speaks the wire format by hand (bench/hostile.py), then checks that the
host still serves an honest tenant.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuvirt
from gpuvirt.bench.hostile import RawGuest
from gpuvirt.config import parse_token
from gpuvirt.protocol.mailbox import FRAME_SIZE, Attach, FailReason, Frame, GuestMsg, HostMsg
from helpers import MakeHost, last_seq, wait_event, wait_state

pytestmark = pytest.mark.timeout(180)
UNKNOWN = 0xDEAD  # a message id the host does not know: answered with FAIL, in order


def _double(xp, b) -> None:
    b *= 2


def honest_works(hp, vf: int = 0) -> None:
    with gpuvirt.attach(vf=vf, socket=hp.socket, token=hp.token(vf)) as gpu:
        x = gpu.alloc(8, np.int32)
        x.write(np.arange(8))
        gpu.launch(_double, x).result(10)
        assert x.read().tolist() == [2 * i for i in range(8)]


def token(hp, vf: int) -> bytes:
    return parse_token(hp.token(vf))


def marker_round_trip(g: RawGuest) -> None:
    """Everything sent before has been read and handled once the marker's FAIL is back."""
    g.send(Frame(UNKNOWN, 7))
    while (reply := g.recv()) is not None:
        if reply.msg == HostMsg.FAIL and reply.dw1 == UNKNOWN and reply.dw2 == 1:
            return
    raise AssertionError("the host closed the connection instead of answering")


def test_pre_auth_connections_are_capped(make_host: MakeHost) -> None:
    hp = make_host(host={"max_pending_attach": 4, "attach_timeout_ms": 60_000})
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as attached:
        idle = [RawGuest(hp.socket) for _ in range(4)]
        for g in idle:  # each is really accepted and waiting for its ATTACH
            g.sock.sendall(b"GV")
        extra = RawGuest(hp.socket)
        reply = extra.recv()
        assert reply is not None and reply.msg == HostMsg.FAIL
        assert reply.dw1 == FailReason.TOO_MANY
        assert extra.recv() is None  # and closed
        ev = wait_event(hp, lambda e: e["kind"] == "attach.refused")
        assert ev["data"]["reason"] == "TOO_MANY" and "max_pending_attach" in ev["message"]
        # The guest that was already attached never noticed.
        x = attached.alloc(4, np.int32)
        x.write([1, 2, 3, 4])
        attached.launch(_double, x).result(10)
        assert x.read().tolist() == [2, 4, 6, 8]
        for g in idle:
            g.close()
    honest_works(hp)


def test_a_connection_that_does_not_attach_in_time_is_closed(make_host: MakeHost) -> None:
    hp = make_host(host={"attach_timeout_ms": 200})
    after = last_seq(hp)
    with RawGuest(hp.socket) as g:
        g.sock.sendall(b"GVMB\x01")  # the start of an ATTACH, never finished
        reply = g.recv()
        assert reply is not None and (reply.msg, reply.dw1) == (HostMsg.FAIL, FailReason.BAD_ATTACH)
        assert g.recv() is None
    ev = wait_event(hp, lambda e: e["kind"] == "attach.refused", after=after)
    assert "no ATTACH within 0.2 s" in ev["message"]
    honest_works(hp)


def test_frames_beyond_the_rate_are_read_later_not_dropped(make_host: MakeHost) -> None:
    hp = make_host(host={"max_frames_per_s": 100})
    after = last_seq(hp)
    with RawGuest.attached(hp.socket, 1, token(hp, 1)) as g:
        n = 300
        g.send(*(Frame(UNKNOWN + i) for i in range(n)))
        got = [g.recv() for _ in range(n)]
        assert [f.dw1 for f in got if f is not None] == [UNKNOWN + i for i in range(n)]
        ev = wait_event(hp, lambda e: e["kind"] == "throttled" and e["vf"] == 1, after=after)
        assert "host.max_frames_per_s" in ev["message"]
        honest_works(hp, 0)  # the neighbour is served meanwhile


def test_log_vf_error_floods_are_throttled_before_the_event_log(make_host: MakeHost) -> None:
    hp = make_host(host={"max_frames_per_s": 1_000_000})
    n = 20_000
    with RawGuest.attached(hp.socket, 1, token(hp, 1)) as g:
        after = last_seq(hp)
        g.send(*(Frame(GuestMsg.LOG_VF_ERROR, i) for i in range(n)))
        marker_round_trip(g)
        logged = [e for e in hp.admin.events(after=after, vf=1) if e["kind"] == "vf_error"]
        assert 0 < len(logged) < n // 10
        assert logged[0]["data"]["code"] == 0  # the first of a burst is always written
        hp.admin.events(after=after, wait=0)
        g.send(Frame(GuestMsg.LOG_VF_ERROR, 0xFFFF))  # a later one says how many were dropped
        marker_round_trip(g)
    lines = (hp.config.host.state_path() / "events.jsonl").read_text().count('"vf_error"')
    assert lines < n // 10
    honest_works(hp)


def test_refused_attaches_are_throttled_before_the_event_log(make_host: MakeHost) -> None:
    hp = make_host()
    after = last_seq(hp)
    n = 300
    bad = Attach(1, b"\x01" * 32).encode()
    for _ in range(n):
        with RawGuest(hp.socket) as g:
            g.send_raw(bad)
            reply = g.recv()
            assert reply is not None and reply.dw1 == FailReason.BAD_TOKEN
    refused = [e for e in hp.admin.events(after=after) if e["kind"] == "attach.refused"]
    assert 0 < len(refused) < n // 2
    honest_works(hp)


def test_reset_request_floods_start_one_flr_and_no_tasks_pile_up(make_host: MakeHost) -> None:
    # VF0's guest never answers FLR_NOTIFICATION, so an admin reset of VF0 holds the
    # lifecycle lock for the whole ready_to_reset wait; VF1 floods REQ_GPU_RESET_ACCESS
    # meanwhile. One FLR of VF1 follows, and the host does not hold a task per frame.
    hp = make_host(host={"max_frames_per_s": 1_000_000}, reset={"ready_to_reset_wait_ms": 8000})
    with (
        RawGuest.attached(hp.socket, 0, token(hp, 0)) as slow,
        RawGuest.attached(hp.socket, 1, token(hp, 1)) as flood,
    ):
        assert slow.init() is not None
        rss_before = hp.status()["host_rss_bytes"]
        after = last_seq(hp)
        resetting = threading.Thread(target=hp.admin.vf, args=(0, "reset"))
        resetting.start()
        wait_event(hp, lambda e: e["kind"] == "flr.start" and e["vf"] == 0, after=after)
        n = 200_000
        flood.send(*(Frame(GuestMsg.REQ_GPU_RESET_ACCESS) for _ in range(n)))
        marker_round_trip(flood)
        grown = hp.status()["host_rss_bytes"] - rss_before
        resetting.join(60)
        wait_state(hp, 1, "AVAIL")
        vf1 = hp.admin.vf(1)
        assert vf1["flr_count"] == 1, vf1
        assert grown < 40 << 20, f"host grew by {grown >> 20} MiB while the flood waited"
    honest_works(hp, 1)


def test_liveness_is_answered_while_a_request_waits(make_host: MakeHost) -> None:
    # VF0 holds FULLACCESS (and never releases it); VF1's REQ_GPU_INIT_ACCESS waits for
    # it. VF1 goes on answering QUERY_ALIVE, so it is not declared gone: it sees a
    # second probe, which the host sends only after the first answer arrived in time.
    hp = make_host(scheduler={"fullaccess_timeout_ms": 60_000})
    after = last_seq(hp)
    with (
        RawGuest.attached(hp.socket, 0, token(hp, 0)) as holder,
        RawGuest.attached(hp.socket, 1, token(hp, 1)) as waiter,
    ):
        assert holder.init().msg == HostMsg.READY_TO_ACCESS_GPU
        # The holder stays alive too: it answers its own probes on a thread.
        threading.Thread(target=holder.drain, daemon=True).start()
        waiter.send(Frame(GuestMsg.REQ_GPU_INIT_DATA))
        assert waiter.recv().msg == HostMsg.GPU_INIT_DATA_READY
        waiter.send(Frame(GuestMsg.REQ_GPU_INIT_ACCESS))
        probes = 0
        while probes < 2:
            frame = waiter.recv(answer_alive=False)
            assert frame is not None, "the host dropped the waiting guest"
            assert frame.msg == HostMsg.QUERY_ALIVE
            probes += 1
            waiter.send(Frame(GuestMsg.REQ_GPU_INIT_DATA, frame.dw1, 0x56494C41))
        holder.send(Frame(GuestMsg.REL_GPU_INIT_ACCESS))
        granted = waiter.recv()
        assert granted is not None and granted.msg == HostMsg.READY_TO_ACCESS_GPU
    gone = [e for e in hp.admin.events(after=after) if e["kind"] == "guest.gone"]
    assert gone == []


def test_garbage_mid_frame_disconnects_leave_the_host_serving(make_host: MakeHost) -> None:
    hp = make_host()
    for cut in (1, FRAME_SIZE - 1, FRAME_SIZE + 3):
        with RawGuest.attached(hp.socket, 1, token(hp, 1)) as g:
            g.send_raw(bytes(range(cut)))
            g.sock.shutdown(socket.SHUT_WR)
            while g.recv() is not None:
                pass
        wait_state(hp, 1, "AVAIL")
    honest_works(hp, 1)


U32 = st.integers(0, 0xFFFFFFFF)
FRAMES = st.builds(
    Frame,
    st.one_of(st.sampled_from([int(m) for m in GuestMsg] + [0, 7, 6, 199, 202]), U32),
    st.one_of(st.integers(0, 16), U32),
    st.one_of(st.just(0x56494C41), st.integers(0, 16), U32),
    U32,
)


def back_to_avail(hp, vf: int) -> None:
    """Until the VF can take a guest again, clearing its guard if the frames tripped it."""
    after = last_seq(hp)
    while True:
        s = hp.admin.vf(vf)
        if s["state"] == "AVAIL" and s["guest_pid"] is None:
            return
        if s["state"] == "QUARANTINED":
            hp.admin.vf(vf, "clear-guard")
            continue
        for ev in hp.admin.events(after=after, vf=vf, wait=5):
            after = max(after, ev["seq"])


def test_hypothesis_frame_sequences_at_a_live_host(make_host: MakeHost) -> None:
    hp = make_host(host={"max_frames_per_s": 1_000_000})
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as honest:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frames=st.lists(FRAMES, max_size=150), tail=st.binary(max_size=FRAME_SIZE - 1))
        def attack(frames: list[Frame], tail: bytes) -> None:
            back_to_avail(hp, 1)
            with RawGuest.attached(hp.socket, 1, token(hp, 1)) as g:
                try:
                    g.send(*frames)
                    g.send_raw(tail)
                except OSError:
                    pass  # the frames included a whole fini: the host closed, as it should
            assert hp.alive()

        attack()
        x = honest.alloc(8, np.int32)
        x.write(np.arange(8))
        honest.launch(_double, x).result(10)
        assert x.read().tolist() == [2 * i for i in range(8)]
        assert hp.admin.vf(0)["flr_count"] == 0
    back_to_avail(hp, 1)
    honest_works(hp, 1)
