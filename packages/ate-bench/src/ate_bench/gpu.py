"""Active GPU time of an attempt, sampled through NVML in a background thread.

Every `interval_s` the sampler asks NVML, for each GPU, whether it is busy (utilisation above
zero over NVML's last sample period) and whether it is used by the attempt: one of its compute
processes belongs to the attempt's session (the agent is started in a new session, so every
process it spawns shares its session id unless it detaches on purpose). The time between two
samples counts as active when at least one GPU used by the attempt was busy at the later sample.
Inside containers NVML may report host process ids that mean nothing here; `scope="all"` then
counts any busy GPU (right on a machine dedicated to the benchmark).

The NVML module is a parameter so tests drive the sampler with a fake; by default it is `pynvml`
from nvidia-ml-py, or, where that is not installed, the same calls made through ctypes. Without a
usable GPU the result is None, never 0.
"""

import contextlib
import ctypes
import os
import threading
import time

SCOPES = ("attempt", "all")


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t of the _v2 and _v3 calls
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class CtypesNvml:
    """The few NVML calls the sampler makes, straight from libnvidia-ml through ctypes, for
    machines with a driver but without nvidia-ml-py. Same names as pynvml."""

    MAX_PROCESSES = 256

    def __init__(self, library: str = "libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(library)  # OSError without a driver

    def call(self, name: str, *args) -> None:
        code = self.lib[name](*args)
        if code != 0:
            raise RuntimeError(f"NVML {name} returned error {code}")

    def nvmlInit(self):
        self.call("nvmlInit_v2")

    def nvmlShutdown(self):
        self.call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        count = ctypes.c_uint()
        self.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        return count.value

    def nvmlDeviceGetHandleByIndex(self, index: int):
        handle = ctypes.c_void_p()
        self.call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return handle

    def nvmlDeviceGetUtilizationRates(self, handle) -> Utilization:
        rates = Utilization()
        self.call("nvmlDeviceGetUtilizationRates", handle, ctypes.byref(rates))
        return rates

    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list[ProcessInfo]:
        infos = (ProcessInfo * self.MAX_PROCESSES)()
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            count = ctypes.c_uint(self.MAX_PROCESSES)
            try:
                self.call(name, handle, ctypes.byref(count), infos)
            except AttributeError:  # an older driver without this version of the call
                continue
            return list(infos[: count.value])
        raise RuntimeError("NVML has no nvmlDeviceGetComputeRunningProcesses_v2/_v3")


def load_nvml():
    """pynvml (nvidia-ml-py) when installed, else the driver's library through ctypes, else None."""
    try:
        import pynvml
    except ImportError:
        try:
            return CtypesNvml()
        except OSError:
            return None
    return pynvml


def process_session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


class GpuSampler:
    """Start it, run the attempt, stop it; `active_gpu_time_s` is then the measured seconds."""

    def __init__(self, session_id: int | None = None, nvml=None, interval_s: float = 0.5, scope="attempt"):
        if scope not in SCOPES:
            raise ValueError(f"expected scope in {SCOPES}, got {scope!r}")
        if interval_s <= 0:
            raise ValueError(f"expected a positive sampling interval, got {interval_s}")
        self.session_id = session_id
        self.nvml = load_nvml() if nvml is None else nvml
        self.interval_s = interval_s
        self.scope = scope
        self.active_gpu_time_s: float | None = None
        self.samples = 0
        self.gpus_used: set[int] = set()
        self._handles = []
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "GpuSampler":
        if self.nvml is None:
            return self
        try:
            self.nvml.nvmlInit()
            self._handles = [
                self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())
            ]
        except Exception:  # NVMLError (no driver, no device) and friends: no GPU to measure
            self._handles = []
        if not self._handles:
            return self
        self.active_gpu_time_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="ate-bench-nvml", daemon=True)
        self._thread.start()
        return self

    def set_session(self, session_id: int) -> None:
        self.session_id = session_id

    def _used_by_attempt(self, handle) -> bool:
        if self.scope == "all":
            return True
        try:
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return False
        return self.session_id is not None and any(
            process_session(p.pid) == self.session_id for p in processes
        )

    def sample_once(self) -> bool:
        """True when a GPU used by the attempt is busy now."""
        busy = False
        for index, handle in enumerate(self._handles):
            try:
                utilisation = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except Exception:
                continue
            if utilisation > 0 and self._used_by_attempt(handle):
                self.gpus_used.add(index)
                busy = True
        self.samples += 1
        return busy

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            busy = self.sample_once()
            now = time.monotonic()
            if busy:
                self.active_gpu_time_s += now - last
            last = now

    def stop(self) -> float | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
        return self.active_gpu_time_s

    def summary(self) -> dict:
        return {
            "active_gpu_time_s": self.active_gpu_time_s,
            "samples": self.samples,
            "interval_s": self.interval_s,
            "scope": self.scope,
            "gpus_used": sorted(self.gpus_used),
        }
