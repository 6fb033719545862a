"""How `scripts/gpu-check` runs a step: its command, its time limit, what it printed.

Each step's command runs in a session of its own, with the package from src/
and the carried dependencies of .gpu-deps/ (docs/cuda.md, "Running gpu-check"),
under a time limit. What a step leaves behind (a host daemon and its engines
run in sessions of their own) is found by an environment mark every process of
the step inherits, and killed. What the script's steps are and in which order
is the script's; this module knows none of them. Standard library only: it
runs where gpu-check runs, before the deps step has said what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
MARK = "GPUVIRT_GPU_CHECK_RUN"  # in every process a step starts: how leftovers are found


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def environment() -> dict[str, str]:
    deps = ROOT / ".gpu-deps"
    paths = [str(deps), str(ROOT / "src")]
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}
    env["PYTHONUNBUFFERED"] = "1"
    # A carried bwrap (docs/cuda.md): the sandbox searches only the system's directories
    # and the one the operator names (GPUVIRT_TOOL_PATH), never PATH.
    env["PATH"] = os.pathsep.join([str(deps / "bin"), env.get("PATH", "")])
    env["GPUVIRT_TOOL_PATH"] = str(deps / "bin")
    return env


def kill_leftovers(mark: str) -> list[int]:
    """SIGKILL every process that carries this step's mark (hosts and engines it started)."""
    killed = []
    for pid in processes_with_env(MARK, mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def processes_with_env(name: str, value: str) -> list[int]:
    """Other processes whose environment sets `name` to `value` (those readable)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def run_step(cmd: list[str], timeout: float, env: dict[str, str]) -> dict[str, Any]:
    mark = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**env, MARK: mark}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    leftovers = kill_leftovers(mark)
    if leftovers:
        log(f"killed {len(leftovers)} leftover processes of the step: {leftovers}")
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 1),
        "stdout": stdout,
        "stderr": stderr,
        "killed_leftovers": leftovers,
    }


def last_json(text: str) -> Any:
    """The last top-level JSON object in text (bench --json prints one, indented)."""
    dec = json.JSONDecoder()
    found = None
    i = 0
    while True:
        start = text.find("{", i)
        if start < 0:
            return found
        try:
            obj, end = dec.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        found = obj
        i = end


def failure(res: dict[str, Any], what: str) -> dict[str, Any]:
    why = "timed out" if res["timed_out"] else f"exit {res['rc']}"
    return {
        "ok": False,
        "error": f"{what}: {why} after {res['seconds']} s",
        "stderr_tail": (res["stderr"] or "")[-3000:],
        "stdout_tail": (res["stdout"] or "")[-1500:],
        "killed_leftovers": res["killed_leftovers"],
    }


def pytest_run(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One pytest run, GPUVIRT_REQUIRE_CUDA=1 (a GPU test that skips fails): its closing
    line, counts and every failure, error or skip."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
               f"--junitxml={xml}", *args]  # fmt: skip
        res = run_step(cmd, timeout, {**env, "GPUVIRT_REQUIRE_CUDA": "1"})
        closing = [ln for ln in res["stdout"].splitlines() if re.search(r"\d+ (passed|failed|"
                   r"errors?|skipped)", ln)]  # fmt: skip
        out: dict[str, Any] = {"args": args, "seconds": res["seconds"],
                               "summary": closing[-1] if closing else None}  # fmt: skip
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            assert suite is not None
            out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                            "skipped")})  # fmt: skip
            problems = []
            for case in suite.iter("testcase"):
                for kind in ("failure", "error", "skipped"):
                    el = case.find(kind)
                    if el is not None:
                        text = (el.get("message") or el.text or "")[:600]
                        problems.append(f"{kind}: {case.get('name')}: {text}")
            out["problems"] = problems
        out["ok"] = res["rc"] == 0 and not res["timed_out"] and out.get("tests", 0) > 0
        if not out["ok"]:
            out.update({k: v for k, v in failure(res, "pytest").items() if k != "ok"})
        return out
