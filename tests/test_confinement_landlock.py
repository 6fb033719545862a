"""The Landlock ruleset an engine applies to itself, and on cuda what the driver needs
of it (device/sandbox/landlock.py). No GPU here: the ruleset is checked as data,
and the two grants cuda adds are exercised for real in a process that applies it
(a thread naming through /proc/self/task/<tid>/comm, as cuInit does; a device
ioctl, as the driver's on /dev/nvidia*, tried on /dev/zero)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from landlock import FSAccess

from gpuvirt.device.sandbox import landlock

F = FSAccess
TASK = "/proc/7/task"
NODES = ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]


def test_emu_reads_everywhere_and_writes_only_scratch_and_dev() -> None:
    rules = dict(landlock.rules(["/tmp"], cuda=False, abi=7, devices=NODES, task_dir=TASK))
    assert rules == {
        "/": F.READ_FILE | F.READ_DIR | F.EXECUTE,
        "/dev": F.READ_FILE | F.READ_DIR | F.EXECUTE | F.WRITE_FILE,  # no ioctls
        "/tmp": landlock.handled(7),
    }


@pytest.mark.parametrize("abi", [2, 4, 5, 7])
def test_cuda_adds_its_device_nodes_and_its_own_thread_names(abi: int) -> None:
    devices = [*NODES, "/dev"]  # a directory among them (nvidia-caps) gets no node rule
    rules = landlock.rules(["/tmp"], cuda=True, abi=abi, devices=devices, task_dir=TASK)
    got = dict(rules)
    node = F.READ_FILE | F.WRITE_FILE | (F.IOCTL_DEV if abi >= 5 else F(0))
    assert {d: got[d] for d in NODES} == dict.fromkeys(NODES, node)
    # nothing else there: no MAKE_*, no reads beyond /'s; O_TRUNC from ABI 3 (fopen "w")
    assert got[TASK] == F.WRITE_FILE | (F.TRUNCATE if abi >= 3 else F(0))
    assert got["/dev"] == F.READ_FILE | F.READ_DIR | F.EXECUTE | F.WRITE_FILE
    assert len(rules) == len(got) == 3 + len(NODES) + 1  # /, /dev, nodes, task dir, /tmp
    # every right granted is one the ABI handles (else add_rule would be EINVAL)
    assert all(r & ~landlock.handled(abi) == 0 for _, r in rules)


PROBE = """
import ctypes, fcntl, json, os, sys, threading
from gpuvirt.device.sandbox import landlock
cuda, scratch = sys.argv[1] == "cuda", sys.argv[2]
task = "/proc/%d/task" % os.getpid()
keep = os.open(task, os.O_PATH | os.O_DIRECTORY)  # as restrict_self keeps it
landlock.apply(landlock.rules([scratch], cuda, landlock.abi()[0], ["/dev/zero"], task))
out = {}
def name_it(tid):
    path = "/proc/self/task/%d/comm" % tid
    try:  # as glibc's pthread_setname_np (O_RDWR), then as an fopen("w") (O_TRUNC)
        fd = os.open(path, os.O_RDWR)
        os.write(fd, b"cuda-EvtHandlr")
        os.close(fd)
        with open(path, "w") as f:
            f.write("cuda-EvtHandlr")
        out["comm"] = open(path).read().strip()
    except OSError as e:
        out["comm"] = e.errno
ready, done = threading.Event(), threading.Event()
def worker():
    out["tid"] = threading.get_native_id(); ready.set(); done.wait()
t = threading.Thread(target=worker); t.start(); ready.wait()
name_it(out["tid"]); done.set(); t.join()
def attempt(fn):
    try:
        fn(); return 0
    except OSError as e:
        return e.errno
fd = os.open("/dev/zero", os.O_RDWR)
out["ioctl"] = attempt(lambda: fcntl.ioctl(fd, 0x5401, bytes(64)))  # TCGETS: a device's own
out["oom"] = attempt(lambda: open("/proc/self/oom_score_adj", "w").write("0"))
out["outside"] = attempt(lambda: open("/var/tmp/gv-landlock-probe", "w"))
out["scratch"] = attempt(lambda: open(scratch + "/x", "w").write("x"))
print(json.dumps(out))
"""


def _probe(cuda: bool, scratch: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), "cuda" if cuda else "emu", scratch],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(r.stdout)


def test_the_cuda_grants_work_under_a_real_ruleset_and_nothing_more(tmp_path) -> None:
    assert landlock.abi()[0] >= 5  # this machine's kernel: IOCTL_DEV is handled
    EACCES, ENOTTY = 13, 25
    cuda = _probe(True, str(tmp_path))
    # cuInit's thread naming works; the device's own ioctl reaches the driver (ENOTTY:
    # /dev/zero has none); the process's other /proc files and the host's paths do not
    assert cuda == {**cuda, "comm": "cuda-EvtHandlr", "ioctl": ENOTTY, "oom": EACCES}
    assert (cuda["outside"], cuda["scratch"]) == (EACCES, 0)
    emu = _probe(False, str(tmp_path))
    # the ruleset before cuda's grants: the thread name and the ioctl are refused, which
    # is what made cuInit fail with CUDA_ERROR_OPERATING_SYSTEM under Landlock
    assert (emu["comm"], emu["ioctl"], emu["scratch"]) == (EACCES, EACCES, 0)
