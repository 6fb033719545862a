"""Landlock inside the engine: read and execute anywhere it can see, write only scratch.

bwrap's mount namespace already decides what the engine sees; Landlock is the
second, independent wall (a bind mount made writable by mistake, a path bwrap
did not hide) and is applied by the engine to itself before any tenant code
runs, through the `landlock` binding (ctypes over the three syscalls). The
ruleset handles every filesystem right the kernel's ABI knows, so what a rule
below does not grant is denied.

What the CUDA driver needs beyond that (`cuda` only; each is the engine's own or
a device node bwrap let in, DESIGN.md "Tenant confinement"):
- its device nodes, /dev/nvidia* (nvidiactl, nvidia-uvm, nvidia-uvm-tools,
  nvidiaN): opened O_RDWR (WRITE_FILE) and driven by ioctls, which from ABI 5
  need IOCTL_DEV on the node. Only there: /dev as a whole keeps read and write
  (for /dev/null and the like) without ioctls.
- writes (and O_TRUNC) beneath its own /proc/<pid>/task: cuInit names the threads it starts
  by writing /proc/self/task/<tid>/comm, and a refused write makes it fail with
  CUDA_ERROR_OPERATING_SYSTEM (304) - the failure a ruleset granting write
  under the scratch and /dev (IOCTL_DEV included) still had. A rule binds an
  inode, and procfs makes a new inode when a dentry is looked up afresh, so the
  engine keeps the directory open (the dentry, and with it the rule, stays) for
  its life. What it can write there is its own threads' files: nothing it could
  not do to itself with prctl and the like.
Not granted, because the driver does not need them here: /dev/shm (CUDA IPC
between processes; an engine is one process and gets its FB as a descriptor),
running nvidia-modprobe (a setuid helper the driver runs only when a device
node is missing; no_new_privs and seccomp stop it anyway: load nvidia-uvm on the
host), MAKE_* anywhere but the scratch. Reads of /proc/driver/nvidia, /sys,
/dev/nvidia-caps (MIG capabilities, opened read-only) and the libraries are
covered by the read rule on /. memfd_create (the driver's
shared buffers) is a syscall, not a path: Landlock does not see it.
"""

from __future__ import annotations

import ctypes
import glob
import os

from landlock import FSAccess, LandlockError, Ruleset, landlock_abi_version

READ = FSAccess.READ_FILE | FSAccess.READ_DIR | FSAccess.EXECUTE
NVIDIA_DEVICES = "/dev/nvidia*"
IOCTL_DEV_ABI = 5
SINCE_ABI = {FSAccess.REFER: 2, FSAccess.TRUNCATE: 3, FSAccess.IOCTL_DEV: IOCTL_DEV_ABI}
# The engine's own threads' directory, held open for its life (see above).
_task_dir: int | None = None


def abi() -> tuple[int, str]:
    """The kernel's Landlock ABI version (0 when absent) and why it is absent."""
    try:
        return landlock_abi_version(), ""
    except (LandlockError, OSError, AttributeError, ctypes.ArgumentError) as e:
        return 0, f"Landlock unavailable: {e}"


def rules(
    writable: list[str], cuda: bool, abi: int, devices: list[str], task_dir: str
) -> list[tuple[str, FSAccess]]:
    """(path, rights granted beneath it) for an engine: the whole ruleset, as data."""
    out: list[tuple[str, FSAccess]] = [
        ("/", READ),
        ("/dev", READ | FSAccess.WRITE_FILE),
    ]
    if cuda:
        node = FSAccess.READ_FILE | FSAccess.WRITE_FILE
        if abi >= IOCTL_DEV_ABI:
            node |= FSAccess.IOCTL_DEV
        out += [(dev, node) for dev in devices if not os.path.isdir(dev)]
        # glibc opens comm O_RDWR; an fopen("w") or a shell's ">" adds O_TRUNC, which
        # needs TRUNCATE (ABI 3) - meaningless on procfs, so granted rather than guessed.
        thread_names = FSAccess.WRITE_FILE | (FSAccess.TRUNCATE if abi >= 3 else FSAccess(0))
        out.append((task_dir, thread_names))
    all_rights = handled(abi)
    out += [(path, all_rights) for path in writable]
    return out


def handled(abi: int) -> FSAccess:
    """Every filesystem right ABI `abi` knows: what the binding's Ruleset handles."""
    rights = FSAccess(0)
    for right in FSAccess:
        if abi >= SINCE_ABI.get(right, 1):
            rights |= right
    return rights


def restrict_self(writable: list[str], cuda: bool = False) -> None:
    """From now on this process (and its threads to come) writes only beneath
    `writable`, /dev's existing files and, on cuda, what the driver needs (above)."""
    global _task_dir
    task, devices = "", []
    if cuda:
        _task_dir = os.open("/proc/self/task", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        task = os.readlink(f"/proc/self/fd/{_task_dir}")  # /proc/<pid>/task, resolved
        devices = sorted(glob.glob(NVIDIA_DEVICES))
    apply(rules(writable, cuda, landlock_abi_version(), devices, task))


def apply(ruleset: list[tuple[str, FSAccess]]) -> None:
    r = Ruleset()
    for path, rights in ruleset:
        r.allow(path, rules=rights)
    r.apply()
    # The binding keeps the ruleset's descriptor open; the engine keeps only its own.
    os.close(r._fd)
