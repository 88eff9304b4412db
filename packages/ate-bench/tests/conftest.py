"""Shared test helpers of ate-bench: a fake NVML module for the GPU sampler."""

from types import SimpleNamespace

import pytest


class FakeNvml:
    """Just the pynvml calls the sampler makes. GPU i reports `utilisation[i]` and runs
    `pids[i]`."""

    def __init__(self, utilisation, pids, fail_init=False):
        self.utilisation, self.pids, self.fail_init = utilisation, pids, fail_init
        self.shutdowns = 0

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.utilisation)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.utilisation[handle], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 20) for p in self.pids[handle]]


@pytest.fixture(name="FakeNvml")
def fake_nvml_class():
    return FakeNvml
