"""Data parallelism, written out: bucketed gradient all-reduce overlapped with backward.

Every rank holds a full replica of the parameters and computes gradients on
its own slice of the batch. Averaging them (the article's g_avg = 1/N sum g_i)
keeps the replicas identical after each optimizer step.

What `torch.nn.parallel.DistributedDataParallel` does, made readable:

1. Gradients live in a few flat buckets (param.grad is a view into one), laid
   out in reverse parameter order, the order backward produces them.
2. A hook on each parameter fires when its gradient has been accumulated.
   When the last gradient of a bucket arrives, that bucket's all-reduce is
   launched asynchronously, while backward goes on computing the gradients
   of earlier layers: communication overlaps computation.
3. `finish_grad_sync()` waits for the in-flight all-reduces and divides by N.

Buckets are launched strictly in order, on every rank, so the collectives
match across ranks even if gradients arrive in a different order (or not at
all, as for an expert that received no token).

`no_sync()` skips the all-reduce for gradient accumulation: gradients of
several micro-batches add up locally and are averaged once, after the last.

Nothing here knows the model: the class takes parameters and a process
group, so one instance can average dense gradients over one group and
another expert gradients over another.

Self-check: torchrun --nproc_per_node 2 dp.py
"""
import copy
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist


def broadcast_parameters(params, group=None):
    """Copy the group's first rank's parameters to every rank (replicas start identical)."""
    src = dist.get_global_rank(group or dist.group.WORLD, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=src, group=group)


def ring_all_reduce_bytes(nbytes, n_ranks):
    """Bytes each rank sends in a ring all-reduce of nbytes: 2 (N-1)/N * nbytes.

    A reduce-scatter ((N-1)/N) followed by an all-gather ((N-1)/N).
    """
    return 2 * (n_ranks - 1) * nbytes // n_ranks


class Bucket:
    """One flat gradient buffer shared by a few parameters."""

    def __init__(self, params):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.grad_views, offset = {}, 0
        for p in params:
            self.grad_views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = set()  # parameters whose gradient for this step has arrived
        self.work = None    # the in-flight all-reduce, once launched


def make_buckets(params, bucket_bytes):
    """Group params (already in gradient-arrival order) into buckets of about bucket_bytes."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size >= bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(Bucket(current))
    return buckets


class DataParallel:
    """Average the gradients of `params` over `group`, overlapped with backward.

    Usage per step:
        for micro_batch in micro_batches[:-1]:
            with dp.no_sync():
                loss(micro_batch).backward()
        loss(micro_batches[-1]).backward()   # all-reduces launch from here
        dp.finish_grad_sync()                 # wait; grads are now averaged
        optimizer.step()
    """

    def __init__(self, params, group=None, bucket_bytes=25 * 2**20, broadcast=True):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.n_ranks = dist.get_world_size(group)
        self.sync = True
        self.comm_bytes = Counter()  # bytes this rank sent, per collective kind
        if broadcast:
            broadcast_parameters(self.params, group)
        self.buckets = make_buckets(reversed(self.params), bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        for p in self.params:
            if p.grad is not None:
                self.bucket_of[p].grad_views[p].copy_(p.grad)
            p.grad = self.bucket_of[p].grad_views[p]
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this block averages them."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _on_grad_ready(self, p):
        bucket = self.bucket_of[p]
        view = bucket.grad_views[p]
        if p.grad is not view:  # the grad was reset to None: move it back into its bucket
            view.copy_(p.grad)
            p.grad = view
        if not self.sync:
            return
        if bucket.work is not None:
            raise RuntimeError("a gradient arrived after its bucket was all-reduced: "
                               "wrap all but the last backward of a step in no_sync()")
        bucket.ready.add(p)
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket):
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        self.comm_bytes["all_reduce"] += ring_all_reduce_bytes(bucket.flat.numel() * bucket.flat.element_size(),
                                                              self.n_ranks)
        self.next_to_launch += 1

    def finish_grad_sync(self):
        """Launch what backward did not (unused parameters count as zero), wait, average."""
        for bucket in self.buckets[self.next_to_launch:]:
            for p in bucket.params:
                if p not in bucket.ready and p.grad is not bucket.grad_views[p]:
                    bucket.grad_views[p].zero_()  # this rank computed no gradient for p
                    p.grad = bucket.grad_views[p]
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat.div_(self.n_ranks)
            bucket.work, bucket.ready = None, set()
        self.next_to_launch = 0

    def zero_grad(self):
        for bucket in self.buckets:
            bucket.flat.zero_()


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node N dp.py
# ---------------------------------------------------------------------------

def _self_check():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device, torch.float64)
    replica = copy.deepcopy(reference)
    steps, micro_batches, per_rank = 3, 2, 4
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    dp = DataParallel(replica.parameters(), bucket_bytes=4096)  # several buckets, so overlap is exercised
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(micro_batches, world, per_rank, 16, generator=g, dtype=torch.float64).to(device)
        y = torch.randn(micro_batches, world, per_rank, 4, generator=g, dtype=torch.float64).to(device)
        # Single device: the whole global batch, accumulated over micro-batches.
        for m in range(micro_batches):
            loss = torch.nn.functional.mse_loss(reference(x[m].flatten(0, 1)), y[m].flatten(0, 1))
            (loss / micro_batches).backward()
        # Data parallel: this rank's slice, all-reduce only after the last micro-batch.
        for m in range(micro_batches):
            with dp.no_sync() if m < micro_batches - 1 else nullcontext():
                (torch.nn.functional.mse_loss(replica(x[m, rank]), y[m, rank]) / micro_batches).backward()
        dp.finish_grad_sync()
        for a, b in zip(reference.parameters(), replica.parameters()):
            worst = max(worst, (a.grad - b.grad).abs().max().item())
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for a, b in zip(reference.parameters(), replica.parameters()):
        worst = max(worst, (a - b).abs().max().item())
    if rank == 0:
        print(f"dp.py self-check on {world} ranks ({backend}): largest difference from one device "
              f"(gradients and parameters, float64, {steps} AdamW steps) = {worst:.3g}")
    dist.destroy_process_group()
    if worst > 1e-12:
        raise SystemExit(f"rank {rank}: data parallel run differs from the single device by {worst:.3g}")


if __name__ == "__main__":
    _self_check()
