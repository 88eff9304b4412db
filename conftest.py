"""Repository-wide pytest setup.

CPU runs execute the Triton kernels through Triton's interpreter, so TRITON_INTERPRET must be set
before anything imports triton; OMP_NUM_THREADS=1 keeps CPU numerics and timing stable; the gpu
marker skips when CUDA is absent; hypothesis gets a deterministic `ci` profile (default) and a
wider `dev` profile (HYPOTHESIS_PROFILE=dev); run_ranks runs a test file as a script, one process
per rank.
"""

import multiprocessing
import os
import shutil
import socket
from pathlib import Path

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Each test module on a CUDA machine starts with torch.compile's caches empty. A compiled function
    compiles at most 8 variants in a process (dynamo's recompile_limit), then runs eagerly: the
    ring-attention tests compile flex_attention for more head layouts and dtypes than that, and a module
    run after them in the same worker got the eager flex, which fails under CUDA graph capture
    (`test_cuda_graph_steps_train_like_eager_steps[False-True]` on an H100)."""
    yield
    import torch

    if torch.cuda.is_available():
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def reference_ops():
    """The operators' PyTorch references and one intra-op thread, for a module of tests of the framework
    rather than of the kernels (pith-ops tests those against their references, and the interpreter is
    orders of magnitude slower). One thread: MKL adapts its thread count to the machine's load, which
    changes float summation order between runs (bit-exact resume tests would see it), and on a busy
    2-core box two threads are far slower than one for tiny matrices. Per module, not per session: a
    session fixture stayed set for the other packages' tests a worker ran next (pith-ops' kernel tests
    then ran their references)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("pith_ops._common.INTERPRET", False)
        yield
    torch.set_num_threads(threads)


# Imported once, in multiprocessing's fork server, for every rank of the session: a rank forked from it
# starts at once, where a fresh `python` spends seconds of CPU importing these (on a 2-core box, most
# of a small distributed test). Nothing of pith's: pith_ops reads TRITON_INTERPRET when imported.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
PRELOAD += ["numpy", "hypothesis", "pytest"]
# What a forked rank runs (exec'd with SCRIPT, ARGV, LOG, ENV): `python SCRIPT *ARGV` with its output to
# LOG, under the environment torchrun gives a worker; the Triton kernels' plain-PyTorch references
# (no interpreter) for speed.
RANK = """
import os, runpy, sys
log = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(log, 1)
os.dup2(log, 2)
os.environ.pop("TRITON_INTERPRET", None)
os.environ.update(ENV, OMP_NUM_THREADS="1")
sys.argv = [SCRIPT, *ARGV]
sys.path.insert(0, os.path.dirname(SCRIPT))
runpy.run_path(SCRIPT, run_name="__main__")
"""


def _run_ranks(script: str, world: int, tmp: Path, *args: str, timeout: float = 400) -> None:
    """Run `python script world rank tmp *args` for every rank, with torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR... set; fail with every rank's output if any rank fails."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with socket.socket() as s:  # a free port for env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [tmp / f"rank_{world}_{rank}.log" for rank in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
        env = {k: str(v) for k, v in env.items()} | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        names = {"SCRIPT": str(script), "ARGV": [str(world), str(rank), str(tmp), *args], "LOG": str(log)}
        procs.append(ctx.Process(target=exec, args=(RANK, {**names, "ENV": env})))
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    report = [
        f"rank {r} (exit {p.exitcode}) ---\n{log.read_text()[-3000:]}"
        for r, (p, log) in enumerate(zip(procs, logs))
    ]
    assert all(p.exitcode == 0 for p in procs), "\n".join(report)


@pytest.fixture(scope="session")
def run_ranks():
    return _run_ranks
