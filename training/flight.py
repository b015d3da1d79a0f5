"""Every rank's record of its collectives, written to the run folder when the run fails, times out or is stopped.

A hang at scale is one rank out of step: it skipped a collective, or called another, or froze. Each rank
keeps the last --record-collectives calls it made to torch.distributed (a ring buffer): for each, the
group's ranks, its number in that group (the n-th collective this rank issued on it), the operation, the
tensors' shapes and dtype, where in this repository it was called from, and when it was issued and
returned (an entry that never returned is where the rank is stuck). On a failure, a collective's timeout
or SIGTERM, every rank writes `collectives/rank<r>.json`; `python -m tools.diagnose RUN_FOLDER` lines
the ranks' records up and names the first collective they disagree on.

Why not PyTorch's own flight recorder alone: on gloo (PyTorch 2.13) it records no process group's ranks,
no point-to-point operation and nothing of the default group, so it cannot say which ranks should have met.
This record is the same on every backend; under NCCL, where a collective returns once it is enqueued, the
order and call sites still show who is out of step, and PyTorch's recorder (TORCH_FR_BUFFER_SIZE,
TORCH_NCCL_DUMP_ON_TIMEOUT: docs/diagnosing.md) adds the GPU side. Costs a few microseconds a call.
"""
import collections
import contextlib
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from training.launch import REPO, WRAPPERS, ours, where

RECORDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
            "reduce_scatter_single", "all_to_all_single",
            "broadcast", "barrier", "all_gather_object", "broadcast_object_list", "send_object_list",
            "recv_object_list", "batch_isend_irecv")
SITE_FRAMES = 6  # this repository's frames kept of each call: enough to tell one layer's call from another's


def shapes_of(args, kwargs):
    """The shapes and dtypes of a call's tensors (and of the lists of them, e.g. all_gather's outputs)."""
    found = []
    for value in [*args, *kwargs.values()]:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if hasattr(item, "shape") and hasattr(item, "dtype"):
                found.append([list(item.shape), str(item.dtype).replace("torch.", "")])
    return found


def call_site(frame):
    """'file:line function' of this repository's frames from `frame` outwards, innermost first."""
    site = []
    while frame is not None and len(site) < SITE_FRAMES:
        path = frame.f_code.co_filename
        if ours(path) and os.path.abspath(path) not in WRAPPERS:  # (stragglers.py's clock wraps this record)
            site.append(f"{os.path.relpath(path, REPO)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return site


def wrap_collectives(wrapper):
    """Replace torch.distributed's collectives (RECORDED), and the names this repository's modules gave them
    (dp.py's all_gather_flat is dist.all_gather_into_tensor, or all_gather_single where PyTorch has it), by
    wrapper(name, original), whose result has `__wrapped__` = original; returns what restore_collectives puts
    back ({(module, attribute): original})."""
    wrapped, originals = {}, {}
    for name in RECORDED:
        if hasattr(dist, name):
            wrapped[id(getattr(dist, name))] = wrapper(name, getattr(dist, name))
    for module in [dist, *(m for m in list(sys.modules.values()) if ours(getattr(m, "__file__", None) or "/"))]:
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped and getattr(wrapped[id(value)], "__wrapped__", None) is value:
                originals[(module, attr)] = value
                setattr(module, attr, wrapped[id(value)])
    return originals


def restore_collectives(originals):
    for (module, attr), original in originals.items():
        setattr(module, attr, original)


class FlightRecorder:
    """The record of this rank's collectives, made by wrapping torch.distributed's functions (install)."""

    def __init__(self, size):
        self.entries = collections.deque(maxlen=size)
        self.issued = collections.Counter()  # per group (its global ranks): collectives this rank issued on it
        self.ranks_of = {}  # id(group) -> its global ranks
        self.lock = threading.Lock()  # the checkpoint saver's thread issues collectives too
        self.folder, self.step, self.originals = None, None, {}

    def install(self):
        self.originals = wrap_collectives(self.recording)
        return self

    def uninstall(self):
        restore_collectives(self.originals)
        self.originals = {}

    def group_ranks(self, group):
        key = id(group)
        if key not in self.ranks_of:
            group = group or dist.group.WORLD
            self.ranks_of[key] = tuple(dist.get_process_group_ranks(group))
        return self.ranks_of[key]

    def note(self, op, group, tensors, site, peer=None):
        """A new entry: this rank's next collective on group (or message to or from peer), called from site."""
        ranks = self.group_ranks(group)
        key = ranks if peer is None else (ranks, peer, op)  # messages are numbered per peer and direction
        with self.lock:
            self.issued[key] += 1
            entry = dict(op=op, group=list(ranks), seq=self.issued[key], shapes=tensors, step=self.step,
                         site=site, issued=time.time(), returned=None,
                         thread=threading.current_thread().name)
            if peer is not None:
                entry["peer"] = peer
            self.entries.append(entry)
        return entry

    def recording(self, name, original):
        def recorded(*args, **kwargs):
            site = call_site(sys._getframe(1))  # the caller's frames, this wrapper left out
            if name == "batch_isend_irecv":  # each message of the batch, numbered per peer and direction
                entries = [self.note(p.op.__name__, p.group, shapes_of([p.tensor], {}), site, p.peer)
                           for p in args[0]]
            else:
                entries = [self.note(name, kwargs.get("group", group_argument(name, args)), shapes_of(args, kwargs),
                                     site)]
            result = original(*args, **kwargs)
            for entry in entries:
                entry["returned"] = time.time()
            return result
        recorded.__wrapped__ = original
        return recorded

    def dump(self, error=None):
        """Write this rank's record into the run folder (nothing before the run folder is known); returns
        the file's path, or None."""
        if self.folder is None or not dist.is_initialized():
            return None
        rank = dist.get_rank()
        os.makedirs(os.path.join(self.folder, "collectives"), exist_ok=True)
        path = os.path.join(self.folder, "collectives", f"rank{rank}.json")
        with self.lock:
            record = dict(rank=rank, world=dist.get_world_size(), wrapped=len(self.entries) == self.entries.maxlen,
                          step=self.step, error=error, written=time.time(), entries=list(self.entries))
        with open(path + ".partial", "w") as f:
            json.dump(record, f)
        os.replace(path + ".partial", path)
        return path


# The position of the group argument of each recorded function, when it is passed positionally.
GROUP_POSITION = {"all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                  "all_gather_single": 2, "reduce_scatter_single": 3,
                  "all_to_all_single": 4, "broadcast": 2, "barrier": 0, "all_gather_object": 2,
                  "broadcast_object_list": 2, "send_object_list": 2, "recv_object_list": 2}


def group_argument(name, args):
    position = GROUP_POSITION.get(name)
    return args[position] if position is not None and len(args) > position else None


class NoRecord:
    """--record-collectives 0: nothing recorded, nothing written."""
    folder = step = None

    def dump(self, error=None):
        return None


@contextlib.contextmanager
def recording(size):
    """A recorder of this process's last `size` collectives (0: none) for the length of the block; if the
    block fails (a collective's timeout, a peer gone, any error), the record is written before the error
    goes on. The caller sets its folder (the run's) and step as they become known."""
    recorder = FlightRecorder(size).install() if size else NoRecord()
    try:
        yield recorder
    except BaseException as error:
        recorder.dump(f"{where(error)}: {type(error).__name__}: {(str(error) or '?').splitlines()[0]}")
        raise
    finally:
        if size:
            recorder.uninstall()
