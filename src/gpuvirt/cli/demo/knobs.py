"""The demo's own knobs (the host's defaults live in gpuvirt.defaults)."""

from __future__ import annotations

JOB_TIMEOUT_S = 1.0  # short, so the hang is caught within seconds at any weight
MATRIX_N = 384  # one launch is two n×n float64 products: a few ms, under one 6 ms slice
DEPTH = 3  # launches in flight per guest: the VF always has work queued
REFRESH_S = 0.5  # live view refresh
PLAIN_FRAME_S = 5.0  # without a terminal, a frame this often (a log, not an animation)
HANG_AT = 0.25  # fraction of the duration after which the hang is started
# What the hostile VF does, in this order: a kernel that never ends, then (once back from
# that reset) one that faults. The coordinator orders each; the guest reports each.
INCIDENTS = ("hang", "fault")
ATTACH_TIMEOUT_S = 90.0
HANG_TIMEOUT_S = 60.0  # each incident must be caught and recovered from within this
NETGPU_RATE = 32 << 20  # bytes/s the sender paces the stream at, so it spans the run
NETGPU_POOL = 32 << 20
NETGPU_CHUNK = 1 << 20
NETGPU_TAIL = 12_345  # odd-sized end of the stream: the last fragment is a partial chunk
STOP_TIMEOUT_S = 30.0
KILL_AFTER_S = 5.0  # after an interruption, guests get this long to go before SIGKILL
QUIET_BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
