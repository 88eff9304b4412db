"""Repository-wide pytest setup.

CPU runs execute the Triton kernels through Triton's interpreter, so TRITON_INTERPRET must be set
before anything imports triton; OMP_NUM_THREADS=1 keeps CPU numerics and timing stable; the gpu
marker skips when CUDA is absent; hypothesis gets a deterministic `ci` profile (default) and a
wider `dev` profile (HYPOTHESIS_PROFILE=dev).
"""

import os
import shutil

if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread: OpenMP workers spin-wait, and on a 2-core box shared by the multi-process
# tests two threads per process ran the tiny models 10x slower (and MKL varied its thread count
# with load, which changed fp32 rounding between identical runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=12,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
