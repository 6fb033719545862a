"""The core confinement checks, run by tests/test_confinement_userns.py AS AN ORDINARY
USER: a host that is not root confines its engines with a user namespace
(bwrap --unshare-user --uid) instead of setpriv. Prints one JSON object: what
the host's sandbox reported, and what each hostile kernel got from the kernel.

argv: uid_base, a file of the user's own that the engine must not see.
"""

from __future__ import annotations

import json
import os
import sys

from gpuvirt.device.sandbox import Sandbox, Settings
from gpuvirt.guest.queue import kernel
from helpers import coop_engine
from hostile import k_identity, k_read_files, k_signal, k_syscalls, k_threads, k_write_files

VF = 3


def main() -> None:
    uid_base, secret = int(sys.argv[1]), sys.argv[2]
    out: dict = {"host_euid": os.geteuid()}
    sandbox = Sandbox.create(Settings(uid_base=uid_base))  # "required": refuses if short
    out["report"] = sandbox.report.as_dict()
    with coop_engine(vf=VF, init_timeout=60, sandbox=sandbox) as (engine, queue):

        def run(k, *args):  # type: ignore[no-untyped-def]
            return queue.launch(kernel(k), args, {}).result(60)

        me = run(k_identity)
        out["identity"] = {k: me[k] for k in ("uid", "gid", "cap_eff", "no_new_privs", "seccomp")}
        out["identity"]["pid"] = me["pid"]
        out["engine_host_uid"] = os.stat(f"/proc/{engine.pid}").st_uid
        out["syscalls"] = run(k_syscalls)
        out["read"] = run(k_read_files, [secret, f"/proc/{os.getpid()}/environ"])
        out["write"] = run(k_write_files, [sys.prefix + "/planted.py", "/planted.py"])
        out["signal"] = run(k_signal, [os.getpid()])
        out["threads"] = run(k_threads, sandbox.settings.tasks + 50)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
