"""Stopping on SIGINT or SIGTERM (pith-train README, Run directory), and `pretrain --nproc-per-node
N`: torchrun's processes without its traceback and exit 1 on a signal."""

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int, step: int, checkpoint):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; saved {checkpoint}")


class StopOnSignal:
    """SIGINT/SIGTERM set a flag rather than kill the process (main thread: Python delivers signals there)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum, self.first, self.previous = 0, 0.0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:  # Ctrl-C reaches a launcher and its workers, and
        # the launcher forwards its own copy: a copy within a second is the same signal
        if self.signum and time.monotonic() - self.first > 1.0:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif not self.signum:
            self.signum, self.first = signum, time.monotonic()
            name = signal.Signals(signum).name
            print(
                f"\n{name}: finishing this step, then saving a checkpoint (again: exit now)", file=sys.stderr
            )


def agreed(value: int, device: torch.device) -> int:
    """The largest `value` of any rank, so all act alike."""
    if not dist.is_initialized():
        return value
    flag = torch.tensor(value, device=device)
    dist.all_reduce(flag, dist.ReduceOp.MAX)
    return int(flag)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the launch line, as its launcher was started."""
    if launched := os.environ.get("PITH_LAUNCH"):  # launch_local's
        return launched
    if agent := torchrun_line():
        return shlex.join(agent)
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world == 1:
        return shlex.join(["pith-train", "pretrain", *argv])
    nodes = [] if world == local else ["--nnodes", str(world // local), "<your rendezvous flags>"]
    return shlex.join(
        ["torchrun", *nodes, "--nproc-per-node", str(local), "-m", "pith_train", "pretrain", *argv]
    )


def torchrun_line() -> list[str] | None:
    """Under torchrun: its agent's (this process's parent's) command line, rendezvous flags and all; the
    workers' env names no rendezvous endpoint (MASTER_PORT is another store's)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0")[:-1]]
    except OSError:  # not Linux
        return None
    starts = [i for i, a in enumerate(argv) if a.endswith("torchrun") or a == "torch.distributed.run"]
    return ["torchrun", *argv[starts[0] + 1 :]] if starts and "TORCHELASTIC_RUN_ID" in os.environ else None


def launch_local(nproc: int, argv: list[str], stdout=None) -> int:
    """`pith-train pretrain ARGV` in nproc processes -> the exit status (killed by signal N: 128 + N).
    Signals are forwarded; a failed worker ends the others."""
    with socket.socket() as s:  # a free port for the env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    env["PITH_LAUNCH"] = shlex.join(["pith-train", "pretrain", "--nproc-per-node", str(nproc), *argv])
    command, workers = [sys.executable, "-m", "pith_train", "pretrain", *argv], []
    forward = lambda signum, frame: [w.send_signal(signum) for w in workers if w.poll() is None]
    previous = {s: signal.signal(s, forward) for s in StopOnSignal.SIGNALS}  # before a worker starts
    try:
        workers += [
            subprocess.Popen(command, stdout=stdout, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(nproc)
        ]
        while True:
            codes = [None if c is None else 128 - c if c < 0 else c for c in (w.poll() for w in workers)]
            if failed := [c for c in codes if c not in (None, 0, 128 + signal.SIGINT, 128 + signal.SIGTERM)]:
                for w in workers:
                    w.terminate()
                deadline = time.monotonic() + 30
                for w in workers:
                    try:
                        w.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        w.kill()
                return failed[0]
            if None not in codes:
                return max(codes)  # a stop's status, or 0
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
