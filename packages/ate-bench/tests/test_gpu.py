"""The NVML sampler against a fake NVML module, and once against the real one (gpu marker)."""

import subprocess
import sys
import time

import pytest
from ate_bench.gpu import CtypesNvml, GpuSampler


@pytest.fixture
def attempt_process():
    """A process in a session of its own, like an agent started by the runner."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_busy_gpu_running_the_attempt_counts(attempt_process, FakeNvml):
    nvml = FakeNvml(utilisation=[0, 87], pids=[[], [attempt_process.pid]])
    started = time.monotonic()
    sampler = GpuSampler(session_id=attempt_process.pid, nvml=nvml, interval_s=0.02).start()
    time.sleep(0.4)
    active = sampler.stop()
    assert 0.25 < active <= time.monotonic() - started
    assert sampler.gpus_used == {1} and nvml.shutdowns == 1


def test_busy_gpu_of_another_process_does_not_count(attempt_process, FakeNvml):
    import os

    nvml = FakeNvml(utilisation=[100], pids=[[os.getpid()]])  # pytest's process: another session
    sampler = GpuSampler(session_id=attempt_process.pid, nvml=nvml, interval_s=0.02).start()
    time.sleep(0.2)
    assert sampler.stop() == 0.0 and sampler.samples > 3


def test_scope_all_counts_any_busy_gpu(FakeNvml):
    nvml = FakeNvml(utilisation=[50], pids=[[999_999_999]])  # a host pid invisible from here
    sampler = GpuSampler(nvml=nvml, interval_s=0.02, scope="all").start()
    time.sleep(0.2)
    assert sampler.stop() > 0.1


def test_idle_gpu_counts_zero(attempt_process, FakeNvml):
    nvml = FakeNvml(utilisation=[0], pids=[[attempt_process.pid]])
    sampler = GpuSampler(session_id=attempt_process.pid, nvml=nvml, interval_s=0.02).start()
    time.sleep(0.15)
    assert sampler.stop() == 0.0


def test_no_gpu_gives_none(FakeNvml):
    assert GpuSampler(nvml=FakeNvml([], [])).start().stop() is None
    assert GpuSampler(nvml=FakeNvml([10], [[]], fail_init=True)).start().stop() is None


def test_bad_arguments_are_rejected(FakeNvml):
    with pytest.raises(ValueError, match="scope"):
        GpuSampler(nvml=FakeNvml([], []), scope="some")
    with pytest.raises(ValueError, match="interval"):
        GpuSampler(nvml=FakeNvml([], []), interval_s=0)


def test_ctypes_nvml_without_a_driver_is_an_os_error():
    with pytest.raises(OSError):
        CtypesNvml("libnvidia-ml-that-does-not-exist.so")


@pytest.mark.gpu
@pytest.mark.parametrize("binding", ["default", "ctypes"])
def test_real_nvml_measures_a_busy_gpu_for_about_a_second(binding):
    import os

    import torch

    nvml = CtypesNvml() if binding == "ctypes" else None
    any_gpu = GpuSampler(nvml=nvml, scope="all", interval_s=0.05).start()
    assert any_gpu.active_gpu_time_s is not None, "NVML found no GPU"
    ours = GpuSampler(session_id=os.getsid(0), nvml=nvml, interval_s=0.05).start()  # this process's session
    a = torch.randn(8192, 8192, device="cuda")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    active, attributed = any_gpu.stop(), ours.stop()
    # `attributed` is ~1 s where NVML reports pids of this pid namespace, 0 in containers that
    # report host pids (then run with --gpu-scope all): printed, not asserted.
    gpus = sorted(any_gpu.gpus_used)
    print(f"real NVML: {active:.2f}s busy of ~1s ({any_gpu.samples} samples, GPUs {gpus}); ", end="")
    print(f"attributed to this process's session: {attributed:.2f}s")
    assert 0.5 < active < 1.5
