"""What a node has (GPUs, cores) and how worker processes share it, asked without importing torch.

The driver, the rollout manager and the engine actors never compute with torch; importing it only to
ask whether there is a GPU cost each of them about a second of CPU and 250 MB at start-up (measured
2026-12-04 on 2 cores). A process that has torch loaded asks torch, so the answer is always that of
the library that will use the GPU; the others ask the CUDA driver, as ``torch.cuda.is_available``
does underneath (``cuInit``, then the count of devices ``CUDA_VISIBLE_DEVICES`` leaves visible).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys


def has_gpu() -> bool:
    """True when CUDA is usable in this process; ``SLIME_FORCE_CPU=1`` forces the CPU path."""
    if os.environ.get("SLIME_FORCE_CPU", "0") == "1":
        return False
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return cuda_device_count() > 0


@functools.cache
def cuda_device_count() -> int:
    """The CUDA devices this process sees, from the driver library itself (0 without one)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def worker_env(processes_per_node: int, spare_cores: int = 0) -> dict[str, str]:
    """Environment for worker processes: on the CPU, split the cores so workers do not oversubscribe.

    ``spare_cores`` of the node are left out of the split for work that runs beside the workers'
    forwards (at least one thread each). ``SLIME_WORKER_THREADS`` overrides the split (a benchmark
    gives each worker exactly one core).
    """
    if has_gpu():
        return {}
    cores = (os.cpu_count() or 1) - spare_cores
    split = max(1, cores // max(processes_per_node, 1))
    threads = int(os.environ.get("SLIME_WORKER_THREADS") or split)
    return {"OMP_NUM_THREADS": str(threads), "SLIME_FORCE_CPU": os.environ.get("SLIME_FORCE_CPU", "0")}


ENGINE_SPARE_CORES = 1
"""A CPU node's cores kept out of its engines' threads: while an engine decodes, its HTTP server
thread, the router and the rollout manager parse requests, forward replies and score them beside
it, and a forward whose second thread waits for one of them loses more than that thread gains (the
quickstart's step on 2 cores: 0.266-0.272 s with one engine thread, 0.285-0.287 s with two; the
trainer, which runs alone, keeps every core)."""


def engine_env(engines_per_node: int) -> dict[str, str]:
    """``worker_env`` of a node's engine servers: ``ENGINE_SPARE_CORES`` left to the HTTP path."""
    return worker_env(engines_per_node, spare_cores=ENGINE_SPARE_CORES)
