"""NetGPU: receive TCP streams straight into a VF's device memory.

    pool = gpu.netgpu.pool(nbytes=256 << 20, chunk=1 << 20)
    for frag in pool.listen(("0.0.0.0", 9000), streams=4, framed=True):
        use(frag.array())           # a view of the FB; nothing copied
        pool.release([frag.token])  # like SO_DEVMEM_DONTNEED

See docs/netgpu.md. The pieces: pool.py (chunks, tokens, backpressure),
rx.py (sockets → fragments), frag.py (a fragment and its views), tx.py (the
sender), providers/ (how bytes reach device memory).
"""

from gpuvirt.netgpu.errors import NetGPUError, RxError, StreamError, TokenError
from gpuvirt.netgpu.frag import Frag, FragBuffer
from gpuvirt.netgpu.pool import NetGPU, Pool
from gpuvirt.netgpu.rx import Rx

__all__ = [
    "Frag",
    "FragBuffer",
    "NetGPU",
    "NetGPUError",
    "Pool",
    "Rx",
    "RxError",
    "StreamError",
    "TokenError",
]
