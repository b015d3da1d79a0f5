"""How train.py joins a launch and leaves it: the process group, signals, and failing on every rank alike.

torchrun (or a plain `python train.py`, a one-rank group) starts the ranks; init_distributed joins
them under a key prefix of this attempt's own, so a restart by torchrun --max-restarts never meets the
dead attempt's addresses. Preemption turns SIGTERM/SIGINT into a stop after the step in progress;
exit_with_error makes every rank say why the run cannot go on before torchrun tears the others down;
in_collective and where name the collective a failed rank was waiting in.
"""
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the top folder

def rank_and_world():
    """This process's rank and the launch's number of ranks, known before any process group forms: the group's
    where one exists already (a test's), else torchrun's RANK and WORLD_SIZE (0 and 1 under plain python)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(timeout=timedelta(minutes=5)):
    """Join the launch's process group (or make a one-rank group); returns this rank's device.

    On GPUs (one per rank) the group has two backends: NCCL for CUDA tensors, the training's
    collectives, and gloo for CPU tensors, the small bookkeeping (log records, the gathers of
    checkpoints), since NCCL takes CUDA tensors only. mesh.py's groups inherit both. Binding the
    device creates NCCL's communicators now rather than at a first collective that not every rank
    of a group might join (a pipeline's first point-to-point).
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend, device_id = ("cpu:gloo,cuda:nccl", device) if cuda else ("gloo", None)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        store = launcher_store(rank, world) if "WORLD_SIZE" in os.environ else dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device_id,
                                timeout=timeout)
    return device


def launcher_store(rank, world):
    """The launch's key-value store, under a prefix of this attempt's own.

    The ranks meet there to exchange their addresses. When torchrun restarts the workers of a run that
    failed, the store is the same and still holds the dead workers' addresses: read by a new rank
    before its peer has written its own, one sends it to a closed port and the restart fails. Keys
    under the restart count's prefix are only ever this attempt's.
    """
    hosted_by_launcher = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's own
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not hosted_by_launcher)
    return dist.PrefixStore(attempt_prefix(), store)


def attempt_prefix():
    """A prefix for the keys of this attempt of the launch (torchrun counts its restarts)."""
    return f"train.py/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Preemption:
    """SIGTERM or SIGINT (a scheduler's notice, or torchrun passing on its own) asks the run to stop after
    the step in progress, with a checkpoint; a second one ends the process at once (its default)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            self.previous = {s: signal.signal(s, self._request) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _request(self, signum, frame):
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)


def exit_with_error(message, rank, world, status):
    """Say on this rank why the run cannot go on, and exit with `status`.

    Every rank reaches the same verdict (before any communication, from the
    flags; or from a record all ranks share). torchrun stops all ranks as
    soon as one exits, so before exiting each rank counts itself in the
    launcher's key-value store and waits (30 s at most) until every rank has
    printed its message.
    """
    sys.stderr.write(f"[rank {rank}] train.py: error: {message}\n")  # one write: lines of ranks never interleave
    sys.stderr.flush()
    if world > 1 and "MASTER_ADDR" in os.environ:
        store = dist.PrefixStore(attempt_prefix(), dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)))
        store.add("exited", 1)
        deadline = time.monotonic() + 30
        while store.add("exited", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def first_problem(problem, group=None):
    """The first rank's problem (a message, or None for none) of every rank of `group`: so that every rank
    raises the same error, or none does (None: this process alone)."""
    if group is None:
        return problem
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p), None)


def in_collective(error):
    """Whether the communication backend raised this (gloo's and NCCL's errors name themselves)."""
    return isinstance(error, dist.DistError) or any(backend in str(error) for backend in ("gloo", "NCCL"))


def ours(path):
    """Whether a source file is this repository's: inside it, and not an installed package."""
    return not os.path.relpath(path, REPO).startswith(os.pardir) and "site-packages" not in path


# Their wrappers around each collective (flight.py's record, stragglers.py's clock) are not where one waits
WRAPPERS = tuple(os.path.join(REPO, "training", name) for name in ("flight.py", "stragglers.py"))


def where(error):
    """The innermost frame of this repository's code in the error's traceback, 'file:line in function', the
    file named from the top folder (train.py, training/checkpoint.py); installed packages are not ours,
    even in a virtual environment inside the repository."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if ours(os.path.abspath(f.filename)) and os.path.abspath(f.filename) not in WRAPPERS]
    return f"{os.path.relpath(frames[-1].filename, REPO)}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
