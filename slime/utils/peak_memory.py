"""The peak resident memory of a run's whole process tree (Ray, engines, router, trainer ranks), which
the driver logs when the run ends; it imports nothing heavy, as the driver runs it."""

from __future__ import annotations

import threading

import psutil


class PeakMemoryMonitor:
    """Samples the summed RSS of the process tree in a background thread; ``peak_bytes`` is the max seen.

    Sampling misses spikes shorter than the interval, so the figure is a lower bound of the true peak.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> int:
        root = psutil.Process()
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakMemoryMonitor:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
