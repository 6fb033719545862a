"""`gpuvirt demo`: every part of gpuvirt in one run, on the emulated GPU or a real one.

Weighted VFs doing verified work, a NetGPU stream checked by sha256, a hang
and a faulting kernel each caught and reset while the others go on; `gpuvirt top`'s view on screen
meanwhile, then a summary of what was verified; the exit status says
whether everything was. The pieces: coordinator.py drives a run,
worker.py is the guest process, summary.py judges, view.py shows.
"""

from __future__ import annotations

import json as json_mod
import sys
from typing import Annotated

import typer

from gpuvirt.cli import top as top_cli
from gpuvirt.cli.common import fail
from gpuvirt.cli.demo.coordinator import run_demo
from gpuvirt.cli.demo.view import screen, summary_view
from gpuvirt.errors import DeviceError, GpuvirtError

BACKENDS = ("emu", "cuda")


def demo(
    duration: Annotated[
        float, typer.Option(min=1.0, help="Seconds of work (the resets' recovery may add a few).")
    ] = 20.0,
    vfs: Annotated[int, typer.Option("--vfs", min=2, max=8, help="VFs (weights 1..N).")] = 4,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    backend: Annotated[
        str, typer.Option(help="emu (anywhere) | cuda (an NVIDIA GPU through CuPy).")
    ] = "emu",
) -> None:
    """Every part in one run: weighted VFs with verified work, NetGPU, a hang and a fault reset.

    Exit 0: everything verified; 1: something was not; 2: it cannot run here (cuda
    without CuPy or without a usable GPU: the reason is printed).
    """
    if backend not in BACKENDS:
        raise fail(f"--backend {backend!r}: one of {', '.join(BACKENDS)}", 2)
    try:
        with screen(json) as show:
            summary = run_demo(vfs, duration, show, backend)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except DeviceError as e:
        raise fail(f"gpuvirt demo --backend {backend} cannot run here: {e}", 2) from None
    except GpuvirtError as e:
        raise fail(str(e)) from None
    if json:
        sys.stdout.write(json_mod.dumps(summary, indent=2, default=str) + "\n")
    else:
        top_cli.make_console().print(summary_view(summary))
    if not summary["ok"]:
        raise typer.Exit(1)
