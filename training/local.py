"""Run a function on N gloo ranks of this machine, each in its own process, with a deadline.

A hang (a collective that one rank never joins) kills every rank and raises after `timeout` seconds
instead of waiting for ever.

Every rank runs under NCCL's matching rule: NCCL ignores point-to-point
tags, so between two ranks sends and receives match in posting order alone.
gloo honours tags, so a wrong order could pass here and fail on GPUs; with
every tag forced to 0 (`match_by_order_alone`), gloo matches as NCCL does.

The tests run every multi-rank check through it, and python -m tools.parity a user's layout.
"""
import functools
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

mp.set_forkserver_preload(["torch", "torch.distributed", "train"])


class _TagZeroP2POp(dist.P2POp):
    """dist.P2POp with its tag forced to 0 (and torch's own isend/irecv, if given the tagless ones below)."""

    def __new__(cls, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        return super().__new__(cls, getattr(op, "__wrapped__", op), tensor, peer, group, 0, group_peer)

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        super().__init__(getattr(op, "__wrapped__", op), tensor, peer, group, 0, group_peer)


def match_by_order_alone():
    """Make every point-to-point operation of this process tagless, as on NCCL."""
    dist.P2POp = _TagZeroP2POp
    for name in ("isend", "irecv", "send", "recv"):
        setattr(dist, name, _tag_zero(getattr(dist.distributed_c10d, name)))


def _tag_zero(operation):
    @functools.wraps(operation)  # sets __wrapped__, by which _TagZeroP2POp finds torch's own
    def tagless(*args, tag=0, **kwargs):
        return operation(*args, tag=0, **kwargs)
    return tagless


def _rank_main(fn, args, rank, world, port, result_path):
    torch.set_num_threads(1)  # N ranks share 2 cores
    match_by_order_alone()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = {"value": fn(*args)}
        dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, result_path)


def run_on_ranks(world, fn, *args, timeout=120):
    """[fn(*args) on rank 0, ..., on rank world-1]; fn must be importable (a module-level function)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a free port, held here
    ctx = mp.get_context("forkserver")  # ranks fork from a server that has imported torch once
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world, store.port, paths[r])) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world} still running after {timeout}s (a hang?)")
        results = [torch.load(path, weights_only=False) if os.path.exists(path) else
                   {"error": f"exited with code {p.exitcode} and no result"} for path, p in zip(paths, procs)]
    errors = [f"--- rank {r} ---\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [res["value"] for res in results]
