"""Device memory beyond the FBs: what each engine takes, and what is left for FBs.

On cuda every engine is a process with its own CUDA context (the driver's
per-context state, loaded modules, cuBLAS's workspace: a few hundred MiB) and
a pool for its kernels' temporaries (what `a * 2` allocates), both outside
its FB. The FBs are carved from what remains, so that every engine's
allocation fits however the VFs start and restart. One more context is
counted than there are VFs: the spare engine, started ahead of need (see
device/spare.py), holds one while it waits.

All of it is arithmetic on numbers the probe measured; nothing here touches
a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvirt.errors import DeviceError

MiB = 1 << 20
CONTEXT_ALIGN = 2 * MiB  # the driver reserves device memory in pages of this size
# A context grows after start (modules a tenant's kernels load, cuBLAS handles for
# more streams): the measured start-up footprint plus this fraction is budgeted.
CONTEXT_MARGIN = 0.25
SPARES = 1


def _fmt(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


@dataclass(frozen=True)
class EngineMemory:
    """Device memory one engine takes outside its FB: zero on emu."""

    context: int = 0  # its CUDA context, measured at start, margin included
    scratch: int = 0  # the cap on its kernels' temporaries (CuPy's pool limit)


def context_cost(free_alone: int, free_with_engine: int) -> int:
    """One engine context as budgeted, from the free device memory measured without and
    with a warmed-up engine process beside the probe.

    A negative difference (something else freed memory in between) means the
    measurement is unusable: DeviceError, rather than budget nothing.
    """
    used = free_alone - free_with_engine
    if used <= 0:
        raise DeviceError(
            f"measuring one CUDA context failed: free device memory went from "
            f"{_fmt(free_alone)} to {_fmt(free_with_engine)} while an engine context was "
            "created; another process is using the GPU. Retry with the GPU otherwise idle"
        )
    with_margin = int(used * (1 + CONTEXT_MARGIN))
    return -(-with_margin // CONTEXT_ALIGN) * CONTEXT_ALIGN


def engines_overhead(mem: EngineMemory, vf_num: int) -> int:
    """Device memory the engines of `vf_num` VFs and the spare take outside the FBs."""
    return (vf_num + SPARES) * mem.context + vf_num * mem.scratch


def fb_room(free: int, mem: EngineMemory, vf_num: int) -> int:
    """Device memory left for the PF reserve and the FBs of `vf_num` VFs."""
    overhead = engines_overhead(mem, vf_num)
    if overhead >= free:
        raise DeviceError(
            f"{vf_num} VF engines and a spare need {_fmt(overhead)} of device memory outside "
            f"their FBs ({vf_num + SPARES} CUDA contexts of {_fmt(mem.context)}, {vf_num} "
            f"kernel scratch pools of {_fmt(mem.scratch)}), but only {_fmt(free)} is free; "
            "lower sriov.vf_num or device.kernel_scratch"
        )
    return free - overhead
