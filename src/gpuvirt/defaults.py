"""Every default and fixed number of the host, in one place (DESIGN.md, "Configuration").

Other modules read a `HostConfig` or these constants; they never carry their
own copy of a number. The wire format's own numbers are the protocol's, in
protocol/ (which imports nothing of ours): frame sizes, the VF limit
(`mailbox.MAX_VFS`, GIM's 31), the token size (`mailbox.TOKEN_SIZE`), the FB's
reserved head (`info.RESERVED_SIZE`: PF2VF and VF2PF). The host's numbers are
here. Engine-, tenant- and client-side modules (device/, guest/, netgpu/, cli/,
k8s/, bench/) keep their private numbers beside the code that uses them.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

DEFAULT_EMU_FB_TOTAL = 2 * GiB
DEFAULT_PF_FB = 256 * MiB
DEFAULT_KERNEL_SCRATCH = 256 * MiB
DEFAULT_VF_NUM = 4
DEFAULT_POLICY = "liquid"
DEFAULT_TIME_SLICE_MS = 6  # GIM's GFX default
MAX_TIME_SLICE_MS = 500
DEFAULT_CMD_TIMEOUT_MS = 500
DEFAULT_COOP_IDLE_TIMEOUT_MS = 2000
DEFAULT_JOB_TIMEOUT_S = 10.0
DEFAULT_FULLACCESS_TIMEOUT_MS = 1500
DEFAULT_READY_TO_RESET_WAIT_MS = 10
DEFAULT_GUARD_FLR = "3/60s"
DEFAULT_VF_WEIGHT = 1.0
# Per-peer limits on the mailbox and the event log (DESIGN.md, "Untrusted inputs").
DEFAULT_ATTACH_TIMEOUT_MS = 5000  # a connection not attached by then is closed
DEFAULT_MAX_PENDING_ATTACH = 64  # connections not yet attached, all peers together
# ... and of one uid (SO_PEERCRED): one uid's flood leaves the others their slots
MAX_PENDING_ATTACH_PER_UID = 16
# A guest refused for load (TOO_MANY, TOO_MANY_UID) tries again after this, doubling
# up to the cap, within attach()'s own timeout.
ATTACH_RETRY_FIRST_S = 0.05
ATTACH_RETRY_MAX_S = 1.0
DEFAULT_MAX_FRAMES_PER_S = 1000  # per connection; an honest guest sends a handful
DEFAULT_EVENT_LOG_MAX = 16 * MiB  # events.jsonl is rotated past this
DEFAULT_EVENT_LOG_FILES = 4  # rotated files kept: events.jsonl.1 .. .N
DEFAULT_SANDBOX = "required"
DEFAULT_UID_BASE = 200000  # engine uid/gid = uid_base + VF index (host running as root)
DEFAULT_MEMORY_ALLOWANCE = 1 * GiB  # engine memory limit = its VF's FB + this, unless set
DEFAULT_ENGINE_TASKS = 64  # threads an engine may run (it may create no processes)
DEFAULT_ENGINE_NOFILE = 256
DEFAULT_ENGINE_SCRATCH = 64 * MiB
DEFAULT_POLL_US = 200  # gpuvirt/poll.py: haltpoll's guest_halt_poll_ns default
DEFAULT_SOCKET_MODE = 0o660

MIN_VF_FB = 1 * MiB
FB_ALIGN = 64 * KiB  # VFs sized by the split start and end on this boundary

# --- host mechanism constants (not configurable; here so every number lives in one file) ---

ENGINE_START_TIMEOUT_S = 30.0  # INIT_GPU of a fresh engine process: a Python start, not a switch
LIVENESS_INTERVAL_S = 5.0  # QUERY_ALIVE period per guest
LIVENESS_TIMEOUT_S = 2.0  # DESIGN.md: no answer within 2 s = the guest is gone
VF2PF_INTERVAL_MS = 2000  # PF2VF tells the guest this; the host reads VF2PF as often
VF2PF_MAX_BAD = 5  # consecutive bad VF2PF reads before the VF is logged untrustworthy
# A VF's device time as the device measured it and as the host's wall clock saw it: a
# gap over this (percentage points of the device) is reported (/status, vf list, metrics).
DEVICE_DISAGREE_PP = 1.0
# How far below its wall time a slice may be charged on the device's own figure. The
# engine writes that figure and runs the tenant's code, so it may lie low: a liar gains
# at most this fraction of its slices, and a VF whose device really idled longer within
# its slices (launch-bound work, its own host-side gaps) is charged as on the wall.
DEVICE_CHARGE_SLACK = 0.05
ENGINE_START_TRIES = 3  # an OSError (EMFILE, fork failure) may clear; then the VF fails
# The scheduler thread needs the GIL promptly when it wakes for a switch.
SWITCH_INTERVAL_S = 0.0002
RT_PRIORITY = 10  # SCHED_FIFO of the scheduler thread: ahead of engines and guests
LOOP_PRIORITY = 5  # SCHED_FIFO of the host's loop thread: below RT_PRIORITY
IDLE_WAKES_MAX = 4  # idle signals a running engine may send per slice
ESCALATE_EVERY_NS = 1_000_000_000  # unblamed scheduler failures: at most one device reset a second
# weighted: a VF without work for less than this keeps the device time it is owed
REJOIN_NS = 100_000_000
# An engine runs one launch or copy at a time: its words (the tenant's) saying it took
# more than this and has not completed them are not believed beyond it.
MAX_TAKEN = 1
ADMIN_MAX_REQUEST = 16 * KiB  # an admin request's head, and its body
ADMIN_MAX_CLIENTS = 64  # admin requests in flight; more get 503 rather than host memory
ADMIN_MAX_WAIT_S = 30.0  # the longest long-poll of /events
SHARE_WINDOW = 5  # samples (1 s apart) behind a VF's achieved share
MAILBOX_QUEUED_REQUESTS = 16  # per session; past this the mailbox's reader waits for its worker
MAILBOX_READ_FRAMES = 256  # frames one read of a guest's socket takes at most
# Guest-caused events of one kind (refusals, LOG_VF_ERROR): a rate and a burst, per second.
GUEST_EVENTS_PER_S, GUEST_EVENT_BURST = 5.0, 20.0
EVENT_HISTORY_KEEP = 512  # reset and guard events kept per VF: a few hundred FLRs at ~10 each
EVENT_RING_KEEP = 4096  # the newest events kept in memory for /events, all VFs together
