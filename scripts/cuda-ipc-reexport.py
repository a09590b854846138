#!/usr/bin/env python3
"""Can a process export again CUDA memory it imported by IPC?

kvxferd imports each engine's pool with cudaIpcOpenMemHandle. UCX's
cuda_ipc transport makes a remote key with cuIpcGetMemHandle, so RMA
into a pool needs the answer to be yes (docs/architecture.md, "No RMA
from pool to pool"). Needs CuPy and a GPU:
    python3 scripts/cuda-ipc-reexport.py
prints what the importing process got and exits 0 when it could export.
"""
import multiprocessing as mp
import sys


def importer(handle, q):
    import cupy as cp
    rt = cp.cuda.runtime
    cp.cuda.Device(0).use()
    p = rt.ipcOpenMemHandle(handle)
    try:
        rt.ipcGetMemHandle(p + 4096)
        q.put("imported at %#x, exported again: ok" % p)
    except Exception as e:  # the driver's refusal is the finding
        q.put("imported at %#x, export refused: %s" % (p, e))


def main():
    import cupy as cp
    mp.set_start_method("spawn")
    a = cp.zeros(1 << 24, dtype=cp.uint8)
    h = cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)
    q = mp.Queue()
    pr = mp.Process(target=importer, args=(h, q))
    pr.start()
    r = q.get(timeout=60)
    pr.join()
    print("CUDA runtime %d, driver %d: %s" % (
        cp.cuda.runtime.runtimeGetVersion(),
        cp.cuda.runtime.driverGetVersion(), r))
    return 0 if r.endswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
