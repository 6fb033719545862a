"""The engine's seccomp filter: what a GPU context never needs, compiled by libseccomp.

Default allow, deny a list: an interpreter, numpy and CuPy use a wide and
changing set of syscalls, while the ones an escape needs are few and fixed.
Process creation is denied (threads are not): with no child processes,
stopping the engine's pid stops everything the tenant runs, so the world
switch stays a SIGSTOP instead of a freezer round trip (DESIGN.md, "Tenant
confinement"). bwrap loads the program (`--seccomp FD`) just before it execs
the engine, so no code of the tenant ever runs without it.
"""

from __future__ import annotations

import errno
import functools
import os
from typing import Any

CLONE_THREAD = 0x00010000
# Answered with EPERM: introspection of and escape into other processes, kernel
# objects a GPU context has no business with, and privileged operations (the
# engine has no capabilities; this keeps a kernel bug in them out of reach too).
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_getfd", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr", "unshare", "setns",
    "bpf", "perf_event_open", "kexec_load", "kexec_file_load", "keyctl", "add_key",
    "request_key", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "userfaultfd", "personality", "syslog",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "iopl", "ioperm",
    "fanotify_init", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "vhangup", "mbind", "migrate_pages", "move_pages",
    "fork", "vfork",
    # The engine stays on the device's CPU, where the host places it: the world switch
    # posts a stop on the premise that no thread of it runs while the host's does.
    "sched_setaffinity",
    # And at the policy the host gives it (emu's ENGINE_POLICY, SCHED_BATCH: no wake-up
    # preemption of the host's tasks on the device's CPU). Unprivileged, a tenant could
    # still move its threads between the normal policies; real-time needs a capability
    # the engine does not have. The host sets the policy from outside (device/emu.py).
    "sched_setscheduler", "sched_setattr",
)  # fmt: skip
# Answered with ENOSYS, as a kernel without io_uring would (libraries then fall back to
# plain reads and writes): an SQPOLL ring's kernel thread runs off the device's CPU, and
# its IORING_OP_SOCKET makes sockets this filter never sees.
NOT_IMPLEMENTED = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
# The one socket family an engine needs (its own channels are Unix sockets): no network,
# netlink, raw packets, and no AF_VSOCK, which no network namespace covers and which
# reaches the hypervisor on a VM.
ALLOWED_FAMILY = 1  # AF_UNIX
SOCKET_CALLS = ("socket", "socketpair")


def build() -> Any:
    # Imported here: engines import this package (through the device modules) inside
    # the sandbox, where libseccomp cannot be looked up (that forks ldconfig).
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        f.add_rule(sc.ERRNO(errno.EPERM), name)
    # A new process (no CLONE_THREAD) is refused; a thread is not. clone3 passes its
    # flags in memory a filter cannot read, so it answers ENOSYS and glibc falls back
    # to clone, whose flags it can.
    f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    for name in NOT_IMPLEMENTED:
        f.add_rule(sc.ERRNO(errno.ENOSYS), name)
    # The kernel reads the family as a 32-bit int and the filter sees all 64 bits, so
    # "deny these families" misses (1 << 32) | AF_INET. Allowing one exact 64-bit value
    # leaves nothing to smuggle: AF_UNIX with high bits set is refused too (glibc never
    # passes one; it sign-extends the int).
    for name in SOCKET_CALLS:
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.NE, ALLOWED_FAMILY))
    return f


@functools.cache
def program() -> bytes:
    """The compiled BPF program (built once per host)."""
    fd = os.memfd_create("gpuvirt-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as out:
        build().export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A fresh memfd with the program at offset 0: bwrap reads one to its end."""
    fd = os.memfd_create("gpuvirt-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def summary() -> str:
    """What the filter does, for the host's start line (docs/security.md)."""
    denied = len(DENIED) + 1 + len(NOT_IMPLEMENTED)  # + clone of a process
    return f"{denied} syscalls denied, no process creation, no io_uring, sockets AF_UNIX only"


def available() -> str | None:
    """None when libseccomp compiles the filter here, else why not."""
    try:
        program()
    except (ImportError, OSError, RuntimeError, ValueError, AttributeError) as e:
        return f"libseccomp: {e}"
    return None
