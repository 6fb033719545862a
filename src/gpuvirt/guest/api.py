"""What a library built on the guest library may use (NetGPU): one module, one contract.

NetGPU imports the guest layer from here only, and uses only the public names of
what it gets (pyproject.toml's import contract "netgpu reaches the guest library
only through gpuvirt.guest.api", and tests/test_imports.py's check that netgpu
reads no private attribute of a guest object). The guest's modules behind it
(client, memory, queue, staging) may then change their internals freely.

- `Gpu`: `check_attached()`, `alloc_range(n)` / `free_range(offset, generation)`
  (FB ranges the caller manages), `host_view(offset, n)` (the mapped FB, or None
  on cuda), `staging()` (the staging path, or None), `generation`, `closed`, `vf`,
  `info`, `netgpu`.
- `Buffer`: a descriptor of FB memory for `gpu.launch`; `check()` is the hook a
  subclass extends.
- `StagedFB.upload(chunk, nchunks)` → `StagedUpload`: pipelined copies from
  staging chunks into the FB (`acquire`, `commit`, `completed`, `wait`, `drain`).
- `register_netgpu`: how `gpu.netgpu` finds NetGPU (guest/extension.py).
"""

from gpuvirt.guest.client import Gpu
from gpuvirt.guest.extension import register_netgpu
from gpuvirt.guest.memory import ALIGN, Buffer
from gpuvirt.guest.staging import StagedFB, StagedUpload, StagingChunk

__all__ = [
    "ALIGN",
    "Buffer",
    "Gpu",
    "StagedFB",
    "StagedUpload",
    "StagingChunk",
    "register_netgpu",
]
