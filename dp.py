"""Data parallelism: every rank holds the whole model and its own slice of the batch, and the gradients are
averaged, g_avg = 1/N sum_i g_i (g_i: rank i's; N ranks), so that the replicas stay identical; then ZeRO-1,
2 and 3 shard what every rank would otherwise repeat. The article's sections "Data Parallelism" and "ZeRO"
("5D Parallelism from Scratch"); bucketing the all-reduce, overlapped with backward, is PyTorch's DDP (Li
et al., 2020), and ZeRO is Rajbhandari et al., 2020 (its table of bytes per parameter: at ZeRO1).

Contract for copying this file alone: a model offers its parameters, and for ZeRO-3 its `units`, the
submodules whose parameters are gathered together, in forward order. The glue, replicated or sharded:

    sync = DataParallel(model.parameters(), group)  # find_unused_parameters=True: experts may get no token
    optimizer = torch.optim.AdamW(model.parameters())   # (p.grad: p's averaged gradient, in its bucket)
    # or: sync = optimizer = ZeRO1(model, group, torch.optim.AdamW)       (ZeRO2; ZeRO3 with units=...)
    with sync.no_sync(): loss(micro_batch).backward()   # every backward of a step but its last: accumulate
    loss(last_micro_batch).backward(); sync.finish_grad_sync()
    optimizer.step(); optimizer.zero_grad()

Nothing here knows the model. Self-check: torchrun --nproc_per_node 4 dp.py
"""
import copy
import math
import os
import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist


# -- 1. The article's equation taken literally: every gradient averaged as it comes ----------------

class AllReduceEveryGradient:
    """g_avg = 1/N sum_i g_i for each gradient as soon as backward has it: backward waits for each blocking
    all-reduce, and many small tensors pay its latency many times. DataParallel averages without either."""

    def __init__(self, params, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.n_ranks, self.sync = group, dist.get_world_size(group), True
        broadcast_parameters(self.params, group)  # the replicas start identical
        for p in self.params:
            p.register_post_accumulate_grad_hook(_weakly(self._average))

    def _average(self, p):
        if self.sync:  # (inside no_sync the gradients add up, for the next backward outside it to average)
            dist.all_reduce(p.grad, group=self.group)  # sum_i g_i
            p.grad.div_(self.n_ranks)                  # 1/N

    def no_sync(self):
        return set_within(self, "sync", False)

    def finish_grad_sync(self):
        """Nothing to wait for: every average was taken inside backward."""

    grads = property(lambda self: {p: p.grad for p in self.params})  # (what ReplicatedOptimizer steps with)


# -- 2. Buckets all-reduced while backward goes on (DDP's design) ----------------------------------

class Bucket:
    """A few parameters whose gradients travel together, in one flat buffer `grad` (p.grad is p's view of it:
    DDP's gradient_as_bucket_view), padded to a multiple of the group size for ZeRO's equal shards."""

    def __init__(self, params, n_ranks, grad_dtype=None):
        self.params, self.offsets, numel = params, {}, 0
        for p in params:
            self.offsets[p], numel = numel, numel + p.numel()
        self.padded = math.ceil(numel / n_ranks) * n_ranks
        self.grad = torch.empty(self.padded, dtype=grad_dtype or params[0].dtype, device=params[0].device)
        self.grad_views = {p: self.view(self.grad, p) for p in params}
        self.zero_grad()
        for p in params:
            if p.grad is not None:  # a gradient from before
                self.grad_views[p].copy_(p.grad)
            p.grad = self.grad_views[p] if is_allocated(self.grad) and self.grad.dtype == p.dtype else None
        self.ready, self.launched, self.work = set(), False, None  # this step's: arrived; issued; in flight

    full = property(lambda self: len(self.ready) == len(self.params))  # every gradient has arrived

    def view(self, flat, p):  # p's place inside a flat buffer laid out like this bucket
        return flat[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)

    def grad_view(self, p):
        return self.grad_views[p]

    def add_grad(self, p, first):
        """p's new gradient into its place: the step's first copied, the next micro-batches' added (a bucket
        wider than the weights, grad_dtype, takes each gradient and drops it: see reduce_dtype)."""
        view = self.grad_view(p)
        if p.grad is not view:  # (else autograd added into the bucket itself)
            view.copy_(p.grad) if first else view.add_(p.grad)
            p.grad = view if view.dtype == p.dtype else None

    def zero_grad(self):
        self.grad.zero_()


def make_buckets(params, bucket_bytes, n_ranks, grad_dtype=None, kind=Bucket):
    """Group params (already in gradient-arrival order) into buckets of about bucket_bytes of gradients."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size >= bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(kind(current, n_ranks, grad_dtype))
            current, size = [], 0
        current.append(p)
        size += p.numel() * (grad_dtype or p.dtype).itemsize
    if current:
        buckets.append(kind(current, n_ranks, grad_dtype))
    return buckets


class DataParallel:
    """Average the gradients of `params` over `group`, bucket by bucket, overlapped with backward.

    A gradient arrives (`_on_grad_ready`) -> its bucket is full -> its all-reduce is launched,
    asynchronously (`_reduce`), while backward computes earlier layers' -> `finish_grad_sync()` waits and
    divides by N (`_complete`); ZeRO-1 overrides those two. Buckets launch in order, alike on every rank, so
    the collectives match where gradients come in another order or not at all (an expert no token
    reached): backward's end launches the rest, a missing gradient as zero. Keywords: after the banner.
    """

    bucket_kind = Bucket          # (ZeRO-2 and 3 free theirs between backwards)
    keeps_full_parameters = True  # between uses (ZeRO-3 does not)

    def __init__(self, params, group=None, bucket_bytes=25 * 2**20, *,  # beyond the article:
                 broadcast=True, divide_by=None, find_unused_parameters=False, reduce_dtype=None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.n_ranks = group, dist.get_world_size(group)
        self.divide_by = divide_by or self.n_ranks  # the N of 1/N sum_i g_i
        self.find_unused_parameters, self.reduce_dtype = find_unused_parameters, reduce_dtype
        self.sync, self.keep_incomplete = True, False  # inside no_sync, keep_incomplete_buckets: the reverse
        self.end_of_backward_queued = False   # the running backward's end will launch what it left
        self.arrived, self.grads = set(), {}  # who got a gradient here this step; then each one's average
        self.comm_bytes = Counter()           # bytes this rank sent, per collective kind
        if broadcast:
            broadcast_parameters(self.params, group)  # the replicas start identical
        self.buckets = self._make_buckets(bucket_bytes)  # (each parameter's p.grad now its view of one)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(_weakly(self._on_grad_ready))

    def _make_buckets(self, bucket_bytes):  # in backward's order: the parameters' reversed
        return make_buckets(reversed(self.params), bucket_bytes, self.n_ranks, self.reduce_dtype, self.bucket_kind)

    def no_sync(self):  # accumulate gradients locally; the next backward outside this block averages them
        return set_within(self, "sync", False)

    def _on_grad_ready(self, p):  # p's hook: its gradient from this backward is complete
        self._expect_end_of_backward()
        bucket = self.bucket_of[p]
        if self.sync and bucket.launched:
            raise RuntimeError("a gradient arrived after its bucket was reduced: "
                               "wrap all but the last backward of a step in no_sync()")
        bucket.add_grad(p, first=p not in self.arrived)  # added to the earlier micro-batches'
        self.arrived.add(p)
        if self.sync:
            bucket.ready.add(p)
            self._launch_ready_buckets()

    def _launch_ready_buckets(self):  # in order, those whose gradients have all arrived
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].full:
            self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket):
        with torch.profiler.record_function(f"dp.reduce bucket {self.next_to_launch}"):  # (a trace's name)
            self._reduce(bucket)
        bucket.launched, self.next_to_launch = True, self.next_to_launch + 1

    def _reduce(self, bucket):
        bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)  # sum_i g_i
        self.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", bucket.grad.nbytes, self.n_ranks)

    def _expect_end_of_backward(self):  # at a backward's first gradient: its end launches what it leaves
        if not self.end_of_backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(_weakly(self._end_of_backward))
            self.end_of_backward_queued = True

    def _end_of_backward(self):
        self.end_of_backward_queued = False
        if self.sync and not self.keep_incomplete:
            self._launch_remaining()

    def _launch_remaining(self, upto=None):  # all not yet launched (before `upto`), a missing gradient as zero
        for bucket in self.buckets[self.next_to_launch:upto]:
            for p in set(bucket.params) - self.arrived:  # (what its view holds is an older step's)
                bucket.grad_view(p).zero_()
            self._launch(bucket)

    def finish_grad_sync(self):
        """Launch what backward did not, wait, average: self.grads[p] (and p.grad, in p's dtype) is p's."""
        self._launch_remaining()
        self._wait_all()
        self._keep_used_grads(used_on_some_rank(self))
        self.arrived = set()

    def _wait_all(self):
        for bucket in self.buckets:
            self._wait(bucket)
            bucket.ready, bucket.launched = set(), False
        self.next_to_launch = 0

    def _wait(self, bucket):
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            self._complete(bucket)

    def _complete(self, bucket):
        bucket.grad.div_(self.divide_by)  # 1/N sum_i g_i

    def _keep_used_grads(self, used):  # a parameter no rank used keeps no gradient (None), as on one device
        self.grads = {p: self.bucket_of[p].grad_views[p] if used(p) else None for p in self.params}
        for p, grad in self.grads.items():
            p.grad = grad if grad is None or grad.dtype == p.dtype else None

    averaged_gradients = property(lambda self: [bucket.grad for bucket in self.buckets])  # ZeRO: its shards
    between_micro_batches = no_sync  # around every backward of a step but its last (ZeRO-2 reduces each)

    def keep_incomplete_buckets(self):  # a pipeline's (pp.py): a rank's chunks each have a last backward
        return set_within(self, "keep_incomplete", True)


# -- 3. ZeRO: each rank keeps 1/N of what data parallelism repeats on every rank ------------------

class ZeRO1(DataParallel):
    """ZeRO stage 1 over `group`: the optimizer state sharded; this rank updates only its shards.

    ZeRO (section 5) stops repeating mixed-precision Adam's 2 + 2 + 12 bytes per parameter (its Figure 1):

        DataParallel  nothing sharded                         16     bytes per parameter
        ZeRO1         the optimizer state sharded              4 + 12/N
        ZeRO2         ... and the gradients                    2 + 14/N
        ZeRO3         ... and the parameters (PyTorch's FSDP)      16/N

    Rank r owns the r-th contiguous 1/N of each bucket, a `Shard`. A ring all-reduce is a reduce-scatter and
    an all-gather: `_reduce` reduce-scatters the gradients, `_complete` keeps this rank's part of their
    average, `step` steps the shards and all-gathers the weights: 2 Psi, as DataParallel sends.
    make_optimizer(pieces): the optimizer (say AdamW) over this rank's piece of each parameter (each its
    own step count, as on one device). `units`: the submodules holding these parameters, in forward order.
    """

    def __init__(self, module, group, make_optimizer, units=(), bucket_bytes=25 * 2**20, *,  # beyond the article:
                 broadcast=True, params=None, divide_by=None, find_unused_parameters=False, master_dtype=None,
                 reduce_dtype=None, initial_values=None, replicate_group=None):
        params = list(module.parameters() if params is None else params)
        mine = set(map(id, params))
        self.units = [unit for unit in units if any(id(p) in mine for p in unit.parameters())]
        self.names = {p: name for name, p in module.named_parameters()}
        self.replicas = Replicas(replicate_group, params if broadcast else ())  # hybrid sharding's (else none)
        super().__init__(params, group, bucket_bytes, broadcast=broadcast, divide_by=divide_by or
                         dist.get_world_size(group) * self.replicas.n, find_unused_parameters=find_unused_parameters,
                         reduce_dtype=reduce_dtype or master_dtype)
        self.rank = dist.get_rank(group)
        self.shards = {bucket: Shard(bucket, self, master_dtype, initial_values) for bucket in self.buckets}
        self.optimizer = make_optimizer([piece for shard in self.shards.values() for piece in shard.pieces.values()])
        for i, unit in enumerate(self.units):
            unit.register_forward_hook(partial(self._after_forward, i))

    def _reduce(self, bucket):  # reduce-scatter instead of all-reduce: a ring all-reduce's first half
        shard = self.shards[bucket]
        shard.reduced = torch.empty(shard.size, dtype=bucket.grad.dtype, device=bucket.grad.device)
        bucket.work = reduce_scatter_flat(shard.reduced, bucket.grad, group=self.group, async_op=True)
        self.comm_bytes["reduce_scatter"] += ring_bytes_sent("reduce_scatter", bucket.grad.nbytes, self.n_ranks)

    def _complete(self, bucket):
        shard = self.shards[bucket]
        shard.grad.copy_(self._across_replicas(shard.reduced).div_(self.divide_by))
        shard.reduced = None

    def _across_replicas(self, tensor):  # hybrid sharding's second reduction (without replicas: tensor itself)
        return self.replicas.sum(tensor, self.comm_bytes)

    def _keep_used_grads(self, used):
        super()._keep_used_grads(used)
        for shard in self.shards.values():
            shard.keep_used_pieces(used)

    def zero_grad(self):
        for bucket, shard in self.shards.items():
            shard.grad.zero_()
            bucket.zero_grad()  # (ZeRO-2 and 3: none held between backwards)

    def _after_forward(self, i, module, args, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i):  # its end reduces on every rank, even one no gradient reached (an idle expert)
        self._expect_end_of_backward()

    def step(self):
        """Update this rank's shards, then all-gather the new weights: the all-reduce's second half."""
        self.optimizer.step()
        for work in [self._all_gather(bucket) for bucket in self.buckets]:
            work.wait()

    def _all_gather(self, bucket):
        shard = self.shards[bucket]
        shard.copy_master_into_place()
        self.comm_bytes["all_gather"] += ring_bytes_sent("all_gather", shard.full_params.nbytes, self.n_ranks)
        return all_gather_flat(shard.full_params, shard.mine, group=self.group, async_op=True)

    full_parameters = nullcontext  # every parameter in full for the duration: stages 1 and 2 always hold them

    # What training, checkpoints and the parity check ask of an optimizer (as of ReplicatedOptimizer):
    param_shards = property(lambda self: [shard.master for shard in self.shards.values()])
    grad_shards = averaged_gradients = property(lambda self: [shard.grad for shard in self.shards.values()])

    def pieces(self):  # (name, start, end, piece) of what this rank steps: see Shard.named_pieces
        return [named for shard in self.shards.values() for named in shard.named_pieces(self.names)]

    def gradient_pieces(self):
        return ((name, start, end, piece.grad) for name, start, end, piece in self.pieces())


class TransientBucket(Bucket):
    """ZeRO-2 and 3's bucket: memory only from a backward's first gradient to its reduce-scatter."""

    def zero_grad(self):  # (made with torch.empty and freed at once, never written: p.grad None)
        free_storage(self.grad)

    def grad_view(self, p):  # allocated again for a backward after a reduce-scatter freed it
        if not is_allocated(self.grad):
            allocate_storage(self.grad)
            self.grad.zero_()
        return self.grad_views[p]


class ZeRO2(ZeRO1):
    """ZeRO stage 2: ZeRO-1, and the gradients sharded too.

    No full gradient is kept between backwards: each reduce-scatters its buckets (one in flight at a time) and
    frees them; the shard accumulates. Every backward of a step reduces (`between_micro_batches`): the paper's
    memory, for M reductions of M micro-batches (under a pipeline's `no_sync()`, one)."""

    bucket_kind = TransientBucket  # (nor do the parameters hold their views of the buckets: p.grad None)
    between_micro_batches = nullcontext  # reduce-scatter every backward

    def _expect_end_of_backward(self):
        if not self.end_of_backward_queued and self.next_to_launch == len(self.buckets):
            self._wait_all()  # a new backward: the previous one's reduction finished, alike on every rank
        super()._expect_end_of_backward()

    def _reduce(self, bucket):
        for earlier in self.buckets[:self.next_to_launch]:  # one full gradient bucket in flight at a time
            self._wait(earlier)
        bucket.grad_view(bucket.params[0])  # zeros, where no gradient came since a reduction freed it (idle experts)
        super()._reduce(bucket)
        for p in bucket.params:  # the next backward must not accumulate into a buffer being reduced
            p.grad = None

    def _complete(self, bucket):
        shard = self.shards[bucket]
        shard.grad.add_(self._across_replicas(shard.reduced).div_(self.divide_by))  # the shard accumulates
        shard.reduced = None
        bucket.zero_grad()  # frees it (grad_view allocates it again for the next backward)

    def _keep_used_grads(self, used):
        for shard in self.shards.values():  # no full gradient: the shards hold them
            shard.keep_used_pieces(used)


class ZeRO3(ZeRO2):
    """ZeRO stage 3 (FSDP): ZeRO-2, and the parameters sharded too. Each unit is one bucket.

    A unit's parameters exist in full only while it computes: all-gathered before its forward (the next
    unit's prefetched, overlapping this one's compute), freed after it, gathered again before its backward
    and freed once its gradients are reduce-scattered: 3 Psi per step (the paper's section 7).
    """

    keeps_full_parameters = False

    def __init__(self, module, group, make_optimizer, units=(), bucket_bytes=25 * 2**20, *,  # beyond the article:
                 reshard_after_forward=True, **options):
        if not units:
            raise ValueError("ZeRO-3 needs the units whose parameters are gathered together")
        self.reshard_after_forward, self.lent = reshard_after_forward, set()  # (lent: units another borrows, lend)
        super().__init__(module, group, make_optimizer, units, bucket_bytes, **options)
        self.unit_buckets = self.buckets[::-1]  # buckets are in backward order, units in forward order
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(partial(self._before_forward, i))

    def _make_buckets(self, bucket_bytes):  # one a unit, whatever its size
        mine = set(map(id, self.params))
        params = [[p for p in unit.parameters() if id(p) in mine] for unit in self.units]
        if sorted(id(p) for unit_params in params for p in unit_params) != sorted(mine):
            raise ValueError("ZeRO-3 units must hold every parameter this instance shards exactly once")
        return [self.bucket_kind(unit_params, self.n_ranks, self.reduce_dtype) for unit_params in reversed(params)]

    def _before_forward(self, i, module, args):
        self._gather(i)
        if not self.end_of_backward_queued:  # (recomputed in a backward, the next unit's backward is over)
            self._gather(i + 1, wait=False)  # prefetched: the next unit's gather overlaps this unit's compute

    def _after_forward(self, i, module, args, output):  # (a lent unit waits for its borrower's forward: lend)
        if self.reshard_after_forward and i not in self.lent or not torch.is_grad_enabled():  # (no_grad: no backward)
            self._free_params(self.unit_buckets[i])
        super()._after_forward(i, module, args, output)

    def _before_backward(self, i):
        super()._before_backward(i)
        if self.sync and self.find_unused_parameters:  # launch the units after i: see used_on_some_rank
            self._launch_remaining(upto=len(self.buckets) - 1 - i)
        self._gather(i)                  # backward needs the weights again,
        self._gather(i - 1, wait=False)  # and the unit before this one comes next

    def _launch_ready_buckets(self):  # (experts, find_unused_parameters: see _before_backward)
        if not self.find_unused_parameters:
            super()._launch_ready_buckets()

    def _reduce(self, bucket):
        super()._reduce(bucket)
        self._free_params(bucket)  # all its gradients have arrived: its backward is over

    def step(self):  # this rank's shards; the weights are gathered just in time, at the next forward
        self.optimizer.step()

    def _gather(self, i, wait=True):  # unit i's weights, unless they are or are being (wait=False: prefetch)
        if not 0 <= i < len(self.unit_buckets):
            return
        shard = self.shards[self.unit_buckets[i]]
        if not is_allocated(shard.full_params):
            allocate_storage(shard.full_params)
            with torch.profiler.record_function(f"dp.gather unit {i}"):
                shard.gathering = self._all_gather(self.unit_buckets[i])
        if wait:
            shard.wait_for_gather()

    def _free_params(self, bucket):
        self.shards[bucket].wait_for_gather()
        free_storage(self.shards[bucket].full_params)

    @contextmanager
    def full_parameters(self):  # every unit gathered for the duration (to save or test the model), freed after
        for i in range(len(self.unit_buckets)):
            self._gather(i)
        try:
            yield
        finally:
            for bucket in self.buckets:
                self._free_params(bucket)


# -- 4. What the classes above call -----------------------------------------------------------------

def broadcast_parameters(params, group=None):
    """Copy the group's first rank's parameters to every rank (replicas start identical)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)


@contextmanager
def set_within(obj, attribute, value):  # obj.attribute = value inside the block, then what it was again
    previous = getattr(obj, attribute)
    setattr(obj, attribute, value)
    try:
        yield
    finally:
        setattr(obj, attribute, previous)


def free_storage(t):  # release t's memory, but keep the tensor (and every view of it) for later
    t.untyped_storage().resize_(0)


def allocate_storage(t):
    t.untyped_storage().resize_(t.numel() * t.element_size())


def is_allocated(t):
    return t.untyped_storage().nbytes() > 0


# The flat collectives under torch 2.13's names, or older releases' (a deliberate copy of tp.py's lines)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- Beyond the article ----
# What a production run needs besides the algorithm above, each piece reached from it through one call or
# one object a reader can skip: the bytes counted (ring_bytes_sent), hooks that let go (_weakly), experts
# (used_on_some_rank), hybrid sharding (Replicas), ZeRO's shards with mixed precision (Shard); then what
# only the training around it uses: the replicated optimizer, clipping, model.py's units, the self-check.
#
# The keywords after `*,  # beyond the article:` in the classes above: broadcast=False where the replicas
# were made identical already; divide_by, the N of 1/N sum_i g_i where the loss is averaged over more ranks
# than `group` (experts: every rank with different tokens); find_unused_parameters (used_on_some_rank);
# reduce_dtype, the buckets' dtype: float32 gradients for bfloat16 weights, as Megatron-LM's main_grad,
# so that micro-batches add up, and ranks average, in float32 (Bucket.add_grad); params, which of module's
# parameters a ZeRO instance shards (experts get their own); master_dtype and initial_values (Shard);
# replicate_group (Replicas); and under a pipeline ZeRO-3's reshard_after_forward=False (FSDP2's flag, as
# torchtitan's), which keeps a unit gathered from its first forward to its reduce-scatter: one all-gather
# a step instead of 2M for M micro-batches (keep_incomplete_buckets and no_sync: docs/zero-and-hybrid.md).

def ring_bytes_sent(kind, nbytes, n_ranks):
    """Bytes one rank sends in a ring collective over nbytes of full-size data.

    A reduce-scatter or an all-gather passes N-1 of the N chunks on:
    (N-1)/N * nbytes. An all-reduce is one of each: 2 (N-1)/N * nbytes.
    """
    passes = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind]
    return passes * (n_ranks - 1) * nbytes // n_ranks


def _weakly(method):
    """A hook that calls method without keeping its object alive.

    A parameter holds its hooks, and autograd's C++ side holds the parameter,
    where Python's garbage collector cannot see: a hook holding the
    DataParallel strongly would keep it, and its process group with gloo's
    threads, alive after destroy_process_group, until the interpreter's exit
    (where one of those threads releasing a finished collective can abort
    the process: "terminate called without an active exception").
    """
    method = weakref.WeakMethod(method)
    return lambda *args: method()(*args)


# -- Experts: parameters no rank used keep no gradient -------------------------------------------

def used_on_some_rank(sync):
    """p -> whether some rank of sync's group gave p a gradient this step (always, without
    find_unused_parameters): one small all-reduce (MAX) of a used-mask per step, as DDP's.

    (Under ZeRO-3 a unit's reduce-scatter cannot wait for gradients some rank may never get, yet must come
    at the same place among the gathers on every rank: ZeRO3 launches it as backward reaches the unit
    before it, the first unit's at backward's end.)"""
    if not sync.find_unused_parameters:
        return lambda p: True
    mask = torch.tensor([p in sync.arrived for p in sync.params], dtype=torch.uint8, device=sync.params[0].device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=sync.group)
    sync.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", mask.numel(), sync.n_ranks)
    if hasattr(sync, "replicas"):  # (a ZeRO instance's: hybrid sharding's copies too)
        sync.replicas.sum(mask, sync.comm_bytes, dist.ReduceOp.MAX)
    used = dict(zip(sync.params, mask.tolist()))
    return lambda p: used[p]


# -- Hybrid sharding: shards within a group of N ranks, copies of them across R groups --------------

class Replicas:
    """Hybrid sharding's second reduction: a shard's sum over its shard group, summed over the shard groups
    (blocking, once the reduce-scatter is done; the same order of collectives on every rank).

    Hybrid sharding (FSDP's HSDP, torchtitan's replicate x shard, DeepSpeed's MiCS): a ZeRO instance's
    `group` is only part of the ranks that average these gradients, the rest holding copies of the same
    shards in groups of their own, and `replicate_group` the ranks holding this rank's copy (one per shard
    group). A node on GPUs is a good shard group: the all-gathers (every layer's, under ZeRO-3) and the
    reduce-scatters stay on its fast links, and what crosses nodes is one all-reduce of each shard per step
    (2 (R-1)/R of Psi/N over R replicas, instead of the shard group's (N-1)/N Psi of each collective):
    16/N bytes per parameter under ZeRO-3 for N of the N R ranks. The division is by all of them
    (divide_by, by default N times R). Without a replicate_group there is one copy: nothing to do.
    """

    def __init__(self, replicate_group=None, params=()):
        self.group = replicate_group
        self.n = dist.get_world_size(replicate_group) if replicate_group is not None else 1  # R
        if replicate_group is not None:
            broadcast_parameters(params, replicate_group)  # every shard group starts from the same weights

    def sum(self, tensor, comm_bytes, op=dist.ReduceOp.SUM):
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
            comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", tensor.nbytes, self.n)
        return tensor


# -- ZeRO's shards, mixed precision, and parameters built without memory ----------------------------

def unallocated(shape, dtype, device):
    """A tensor whose memory is not held yet (allocate_storage brings it).

    PyTorch makes no tensor without memory, and makes no view of one whose memory is freed, so such
    tensors are made with torch.empty, their views taken, and freed at once: one at a time, never
    written (on the CPU their pages are never touched; on a GPU the caching allocator keeps the block
    for the next one)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    free_storage(t)
    return t


class Shard:
    """This rank's elements [r S, (r+1) S) of a bucket (S = padded size / N), and what ZeRO keeps of them.

    The bucket's parameters become views of one flat buffer, `full_params`, so one all-gather brings
    them all up to date; `mine` is this rank's place in it. The optimizer steps this rank's elements of
    the weights, `master`, as each parameter's piece (`pieces`, views of `master`), so that, as on one
    device, each parameter has its own step count, and one that no rank gave a gradient (an expert no
    token reached) is skipped: its piece's grad is then None. The gradient shard `grad` is in the
    master's dtype.

    Under ZeRO-1 and 2 (zero.keeps_full_parameters) `full_params` is filled from the parameters and
    `master` is `mine` itself, unless wider. Mixed precision (Megatron-LM's distributed optimizer, FSDP2's
    policy): under bfloat16 weights `master_dtype=torch.float32` keeps this rank's shard of the weights in
    float32 beside them (4 of Adam's 12 bytes), which the optimizer (so AdamW's moments) steps and which
    is copied into `mine` before each all-gather of the bfloat16 weights; the gradients are float32
    unless reduce_dtype says bfloat16 (4 bytes, as Megatron-LM's main_grad, rather than the paper's 2).
    Under ZeRO-3 `full_params` exists only while gathered, so `master` is always a copy of its own.
    initial_values(name, shape, start, end), where given, fills that copy with elements [start, end) of
    the flattened parameter `name` (of this rank's `shape`) instead of the weights, which may have been
    rounded to bfloat16, or, for a model built without memory (meta, then `unallocated`), never filled:
    then no rank ever holds a whole parameter it shards.
    """

    def __init__(self, bucket, zero, master_dtype=None, initial_values=None):
        self.size = bucket.padded // zero.n_ranks
        self.start = zero.rank * self.size
        self.ranges = {}  # parameter: (start, end) of its piece within the shard, for those that have one
        for p in bucket.params:
            lo, hi = max(bucket.offsets[p], self.start), min(bucket.offsets[p] + p.numel(), self.start + self.size)
            if lo < hi:
                self.ranges[p] = (lo - self.start, hi - self.start)
        self.elements = {p: (lo + self.start - bucket.offsets[p], hi + self.start - bucket.offsets[p])
                         for p, (lo, hi) in self.ranges.items()}  # the same piece's [start, end) in flattened p
        kept_whole = zero.keeps_full_parameters
        self.full_params = self._full_params(bucket, filled=kept_whole)
        self.mine = self.full_params[self.start:self.start + self.size]
        dtype = master_dtype or self.mine.dtype
        if kept_whole and dtype == self.mine.dtype:
            self.master = self.mine
        else:
            values = initial_values and (lambda p, start, end: initial_values(zero.names[p], p.shape, start, end))
            self.master = self._own_copy(values or _elements, dtype)
        for p in bucket.params:
            p.data = bucket.view(self.full_params, p)  # the parameter now lives inside the flat buffer
        if not kept_whole:
            free_storage(self.full_params)  # (its views, the parameters, were taken above)
        self.grad = torch.zeros_like(self.master)  # this rank's part of the averaged gradient
        self.reduced = None  # the output of the reduce-scatter in flight
        self.gathering = None  # ZeRO-3: the all-gather of full_params in flight
        self.pieces = {p: self.master[lo:hi] for p, (lo, hi) in self.ranges.items()}
        self.grad_pieces = {p: self.grad[lo:hi] for p, (lo, hi) in self.ranges.items()}
        for p, piece in self.pieces.items():
            piece.grad = self.grad_pieces[p]

    def named_pieces(self, names):
        """(name, start, end, piece) of each parameter this rank updates a piece of: elements [start, end) of
        the flattened parameter `name`, whose optimizer state is the optimizer's state[piece]. A checkpoint
        saves them, each rank its own, and fills them again under any layout."""
        for p, piece in self.pieces.items():
            yield (names[p], *self.elements[p], piece)

    @staticmethod
    def _full_params(bucket, filled):
        """The bucket's weights, flat: holding the parameters' values (the padding zero), or (ZeRO-3) never
        written, each use gathering it first (see unallocated)."""
        weights = bucket.params[0]
        if not filled:
            return torch.empty(bucket.padded, dtype=weights.dtype, device=weights.device)
        flat = torch.zeros(bucket.padded, dtype=weights.dtype, device=weights.device)
        for p in bucket.params:
            bucket.view(flat, p).copy_(p.detach())
        return flat

    def _own_copy(self, values, dtype):
        """This rank's elements of the bucket in `dtype`, each parameter's piece from values(p, start, end):
        its flattened elements [start, end)."""
        mine = torch.zeros(self.size, dtype=dtype, device=self.full_params.device)
        for p, (lo, hi) in self.ranges.items():
            mine[lo:hi] = values(p, *self.elements[p])
        return mine

    def copy_master_into_place(self):
        """The updated master elements into this rank's place in the full weights, in their dtype: what the
        next all-gather sends (nothing to do where the master is that place itself)."""
        if self.master is not self.mine:
            self.mine.copy_(self.master)

    def keep_used_pieces(self, used):
        """A piece of a parameter no rank used this step has no gradient: AdamW leaves it alone."""
        for p in self.pieces:
            self.pieces[p].grad = self.grad_pieces[p] if used(p) else None

    def wait_for_gather(self):
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None


def _elements(p, start, end):
    """Elements [start, end) of a materialised parameter, flattened."""
    return p.detach().reshape(-1)[start:end]


# -- No ZeRO: one optimizer over every parameter ---------------------------------------------------

class ReplicatedOptimizer:
    """No ZeRO: one optimizer over every parameter, the same step on every data-parallel replica.

    It steps the master weights: the parameters themselves, or, where `master_dtype` is wider than the
    weights (bfloat16 weights, float32 master: Megatron-LM's Float16Optimizer), a copy of each, filled by
    fill_master(name, master) (default: from the parameter), whose update is copied into the weights after
    every step. Their gradients are grad_sync's averaged ones (`grad_sync.grads`, {parameter: gradient, or
    None where no rank used it}: DataParallel's, AllReduceEveryGradient's). It offers what the ZeRO classes
    offer the training step, so that one step drives either alike.
    """

    grad_shards = ()  # the gradients stay in grad_sync's buckets

    def __init__(self, named_parameters, make_optimizer, grad_sync, master_dtype=None, fill_master=None):
        self.params, self.grad_sync = dict(named_parameters), grad_sync
        fill_master = fill_master or (lambda name, master: master.copy_(self.params[name].detach()))
        self.masters = {name: self._master(name, p, master_dtype or p.dtype, fill_master)
                        for name, p in self.params.items()}
        self.optimizer = make_optimizer(list(self.masters.values()))

    @staticmethod
    def _master(name, p, dtype, fill_master):
        """The weights the optimizer steps for p: p itself where the dtypes agree, else a copy of its own."""
        if p.dtype == dtype:
            return p
        master = torch.empty(p.shape, dtype=dtype, device=p.device)
        fill_master(name, master)
        return master

    @property
    def param_shards(self):
        return list(self.masters.values())  # the weights themselves, or their master copies

    def zero_grad(self):
        # As on one device: a parameter that gets no gradient this step on any rank (an expert no token
        # reached) has none, and AdamW leaves it alone (no weight decay, no momentum).
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self):
        grads = self.grad_sync.grads
        for name, master in self.masters.items():
            grad = grads[self.params[name]]
            master.grad = None if grad is None else grad.to(master.dtype)  # (itself where the dtypes agree)
        self.optimizer.step()
        for name, master in self.masters.items():
            if master is not self.params[name]:
                self.params[name].copy_(master)  # the weights: the updated master, rounded

    def full_parameters(self):
        return nullcontext()  # every parameter is always here in full

    def pieces(self):
        """(name, start, end, piece), as the ZeRO classes give them: here each piece is a whole master weight."""
        for name, master in self.masters.items():
            yield name, 0, master.numel(), master

    def gradient_pieces(self):
        """(name, start, end, averaged gradient or None) of each piece, once the gradients are synchronised
        and before the step (what a parity check compares with one device)."""
        for name, master in self.masters.items():
            yield name, 0, master.numel(), self.grad_sync.grads.get(self.params[name])


# -- Clipping: one norm of the whole model's gradient, whatever holds it ----------------------------

def held_gradients(optimizer):
    """(parameter, gradient) of what an optimizer steps: a ZeRO instance's pieces of its shards (disjoint
    across its group), or ReplicatedOptimizer's averaged gradients of the parameters some rank used (the
    same on every replica)."""
    if isinstance(optimizer, ZeRO1):
        return [(p, piece) for shard in optimizer.shards.values() for p, piece in shard.grad_pieces.items()]
    return [(p, grad) for p, grad in optimizer.grad_sync.grads.items() if grad is not None]


def squared_norm(optimizer, weights=None):
    """The sum of the squares of the gradient elements an optimizer holds, in float64, each parameter's
    multiplied by weights[p] (1 where weights is None or has no p). A ZeRO instance's shards are disjoint:
    one scalar all-reduce over its group counts each element once (hybrid sharding: over the shard group
    alone, whose replicas hold the same shards). ReplicatedOptimizer's need no collective."""
    squares = torch.zeros((), dtype=torch.float64, device=optimizer.param_shards[0].device)
    for p, grad in held_gradients(optimizer):
        squares += grad.to(torch.float64).square().sum() * (weights.get(p, 1.0) if weights else 1.0)
    if isinstance(optimizer, ZeRO1):
        dist.all_reduce(squares, group=optimizer.group)
        optimizer.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", squares.element_size(), optimizer.n_ranks)
    return squares


def clip_grad_norm_(optimizers, max_norm, weights=None, groups=()):
    """Scale every optimizer's gradients by one factor, so that the whole gradient's norm is at most max_norm
    (as torch.nn.utils.clip_grad_norm_ on one device); returns that norm (float64, before clipping).

    Each optimizer (ReplicatedOptimizer, or a ZeRO instance: the squares of its shards summed over its
    group) gives the squares of the gradient elements it holds. When the model is itself cut across other
    groups (tensor, pipeline, expert parallelism), the squares are summed over each of `groups` too, each
    parameter's multiplied by weights[p] (1/copies for a parameter that ranks of those groups each hold a
    copy of, so every element counts once; 1 for a parameter not in weights), as Megatron-LM's
    clip_grad_norm_fp32 sums over its model-parallel group, leaving out tensor-parallel duplicates.
    """
    squares = sum(squared_norm(optimizer, weights) for optimizer in optimizers)
    for group in groups:
        dist.all_reduce(squares, group=group)
    total_norm = squares.sqrt()
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for optimizer in optimizers:
        for _, grad in held_gradients(optimizer):
            grad.mul_(scale.to(grad.dtype))
    return total_norm


# -- model.py's glue ------------------------------------------------------------------------------

ZERO_STAGES = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


# -- Tied weights under ZeRO-3: a module that borrows a unit's parameters -------------------------------

def lend(zero, borrower, lender):
    """Under ZeRO-3, `borrower`, a module all of whose parameters the unit `lender` holds (model.py's lm_head,
    tied to tok_emb's weight: the same tensor), is no unit of its own but uses its lender's weights, so that
    the weight is gathered, reduced and stepped once, as one parameter.

    The lender (the embedding) keeps its weights gathered from its own forward to the borrower's (the output
    layer, at the forward's end: held through the forward, as FSDP keeps a root unit's), which frees them as
    a unit frees its own; the borrower's backward gathers them again, and they stay until the unit's
    reduce-scatter, once every gradient of the weight has arrived: the output layer's and, last in the
    backward, the embedding's, which autograd adds into one before the weight's gradient hook runs. Two
    all-gathers a forward and backward, as any unit has. Elsewhere (ZeRO-1 and 2 keep the weights whole; a
    lender another instance shards) nothing is lent."""
    if not isinstance(zero, ZeRO3) or lender not in zero.units:
        return
    i, zero_ref = zero.units.index(lender), weakref.ref(zero)
    zero.lent.add(i)
    borrower.register_forward_pre_hook(lambda module, args: zero_ref()._gather(i))
    borrower.register_forward_hook(lambda module, args, output: borrowed_forward(zero_ref(), i, output))


def borrowed_forward(zero, i, output):
    """After a borrowing module's forward: its lender's weights freed (as a unit's own would be), and gathered
    again before its backward."""
    if zero.reshard_after_forward or not torch.is_grad_enabled():
        zero._free_params(zero.unit_buckets[i])
    if torch.is_tensor(output) and output.requires_grad:
        zero_ref = weakref.ref(zero)
        output.register_hook(lambda grad: zero_ref()._gather(i))


def gpt_units(model):
    """ZeRO-3 units of model.py's GPT, in forward order (the only model knowledge in this file). A tied output
    layer on the embedding's rank is none: it borrows the embedding's unit (gpt_lend)."""
    borrows = tied_on_one_rank(model)
    units = [model.tok_emb, model.pos_emb, *model.blocks, model.norm, None if borrows else model.lm_head]
    return [unit for unit in units if unit is not None]  # no position table with rotary embeddings


def gpt_lend(zero, model):
    """A ZeRO instance's lending of model.py's tied output layer (see lend), where it has one."""
    if tied_on_one_rank(model):
        lend(zero, model.lm_head, model.tok_emb)


def tied_on_one_rank(model):
    return model.config.tie_embeddings and model.tok_emb is not None and model.lm_head is not None


# -- Self-check: torchrun --nproc_per_node N dp.py ---------------------------------------------------

def _join_process_group():
    """torchrun's group: on GPUs NCCL for CUDA tensors and gloo for CPU ones, one GPU per rank; else gloo.
    (A deliberate copy in each dimension file: each stands alone.)"""
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    return device


def _self_check():
    # Before the group exists: the first optimizer imports torch._dynamo, which imports a module whose
    # default argument (fsdp's ShardedGradScaler, process_group=dist.group.WORLD) would keep the group
    # alive. destroy_process_group would then leave gloo's threads running, and one still releasing a
    # finished collective's tensors as the interpreter exits aborts the rank ("terminate called without
    # an active exception").
    import torch._dynamo  # noqa: F401
    device = _join_process_group()
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 3)).to(device, torch.float64)
    steps, micro_batches, per_rank, max_norm = 3, 2, 4, 0.05  # max_norm small: clipping is active
    batches = [torch.randn(micro_batches, world, per_rank, 16, generator=torch.Generator().manual_seed(step),
                           dtype=torch.float64).to(device) for step in range(steps)]
    loss_fn = lambda model, x: model(x).square().mean() / micro_batches  # noqa: E731

    # Single device: the whole global batch, accumulated over micro-batches.
    ref_model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for x in batches:
        for m in range(micro_batches):
            loss_fn(ref_model, x[m].flatten(0, 1)).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731

    def replicated(averager):  # (averager, optimizer): an averager and one optimizer over its gradients
        def make(model):
            sync = averager(model.parameters())
            return sync, ReplicatedOptimizer(model.named_parameters(), adamw, sync)
        return make

    def sharded(zero):  # a ZeRO instance is both
        def make(model):
            units = [m for m in model if any(True for _ in m.parameters())]
            sync = zero(model, None, adamw, units=units, bucket_bytes=4096)
            return sync, sync
        return make

    kinds = {  # several buckets of 4 KB: their ordering and overlap are exercised
        "all-reduce every grad": replicated(AllReduceEveryGradient),
        "bucketed, overlapped": replicated(partial(DataParallel, bucket_bytes=4096)),
        "ZeRO-1": sharded(ZeRO1), "ZeRO-2": sharded(ZeRO2), "ZeRO-3": sharded(ZeRO3),
    }
    if world >= 4 and world % 2 == 0:  # hybrid sharding: shards over pairs of neighbours, copies across pairs
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        copies = [dist.new_group(list(range(first, world, 2))) for first in range(2)]
        kinds["ZeRO-3 hybrid, pairs"] = sharded(lambda model, _, *args, **options: ZeRO3(
            model, pairs[rank // 2], *args, replicate_group=copies[rank % 2], **options))
    report = []
    for name, make in kinds.items():
        model = copy.deepcopy(reference)
        sync, optimizer = make(model)
        for x in batches:
            for m in range(micro_batches):  # this rank's slice; reduce after the last micro-batch
                with sync.no_sync() if m < micro_batches - 1 else nullcontext():
                    loss_fn(model, x[m, rank]).backward()
            sync.finish_grad_sync()
            clip_grad_norm_([optimizer], max_norm)
            optimizer.step()
            optimizer.zero_grad()
        with optimizer.full_parameters():
            worst = max((a - b).abs().max().item() for a, b in zip(ref_model.parameters(), model.parameters()))
        report.append((name, worst))
    if rank == 0:
        for name, worst in report:
            print(f"dp.py self-check, {name:21s} on {world} ranks ({backend}): largest difference from one "
                  f"device (parameters after {steps} AdamW steps with clipping, float64) = {worst:.3g}")
    dist.destroy_process_group()
    failed = [name for name, worst in report if worst > 1e-12]
    if failed:
        raise SystemExit(f"rank {rank}: {', '.join(failed)} differ from the single device")


if __name__ == "__main__":
    _self_check()

