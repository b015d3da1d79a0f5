"""Data parallelism, in the article's order: average the gradients; bucket them and overlap the
averaging with backward; then ZeRO-1, 2 and 3, sharding what every rank would otherwise repeat.

The article's section "Data Parallelism", then "ZeRO" ("5D Parallelism from Scratch"); the
bucketed, overlapped all-reduce is PyTorch's DDP (Li et al., 2020, "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training"); the three stages are ZeRO's (Rajbhandari et al., 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", its section 5).

Every rank holds a full replica of the parameters and computes gradients on
its own slice of the batch. Averaging them (the article's equation
g_avg = 1/N sum_i g_i) keeps the replicas identical after each optimizer step.

1. `AllReduceEveryGradient`: the equation as it stands. A hook on each
   parameter all-reduces its gradient the moment backward has it, and
   divides by N; backward waits for every one of them.

2. `DataParallel`: the same average, the way DistributedDataParallel does it.
   Gradients live in a few flat buckets (param.grad is a view into one), laid
   out in reverse parameter order, the order backward produces them. When
   the last gradient of a bucket arrives, that bucket's all-reduce is
   launched asynchronously while backward goes on computing the gradients of
   earlier layers: communication overlaps computation. At the end of backward
   (an autograd callback, as DDP's) the buckets it left incomplete are
   launched too: a parameter that got no gradient on this rank counts as
   zero there, so any collective may follow backward(). `finish_grad_sync()`
   waits and divides by N. Buckets launch strictly in order, on every rank,
   so the collectives match across ranks even if gradients arrive in another
   order (or not at all, as for an expert that received no token).
   `no_sync()` skips the all-reduce for gradient accumulation: gradients of
   several micro-batches add up locally and are averaged once, after the last.
   With bfloat16 weights the buckets may be float32 (`reduce_dtype`, Megatron-
   LM's main_grad): each gradient is then added into its bucket and dropped,
   so micro-batches accumulate, and ranks average, in float32.
   With `find_unused_parameters=True` (as DDP's), a parameter that no rank of
   the group gave a gradient this step (an expert no token reached) keeps
   `grad = None`, as in a single process, so the optimizer skips it (no weight
   decay, no momentum): one small all-reduce (MAX) of a used-mask per step.
   `ReplicatedOptimizer` steps every parameter with those averaged gradients,
   the same step on every replica (master weights wider than bfloat16 ones,
   `master_dtype`, as Megatron-LM's Float16Optimizer keeps them).

3. ZeRO. Data parallelism does not reduce memory: every rank keeps 16 bytes
   per parameter in the article's mixed-precision accounting (2 for the
   weights, 2 for the gradients, 12 for Adam's state). ZeRO stops keeping
   what another rank already has. Each bucket is padded to a multiple of N
   and rank r owns the r-th contiguous 1/N of it (a `Shard`); AdamW runs on
   owned elements only. One class per row of the paper's Figure 1 (the
   (2 + 2 + K) Psi bytes of mixed-precision Adam, K = 12, divided as below),
   each adding its row to the class before it:

       ZeRO1  optimizer state sharded            4 + 12/N  bytes per parameter
       ZeRO2  ... and gradients                  2 + 14/N
       ZeRO3  ... and the parameters themselves       16/N  (what PyTorch calls FSDP)

   `master_dtype=torch.float32` under bfloat16 weights makes that accounting
   real: each rank keeps its shard of the weights in float32 beside them (the
   master the optimizer steps, 4 of Adam's 12 bytes), and gathers the
   bfloat16 weights; its gradients are float32 unless `reduce_dtype` says
   bfloat16 (4 bytes, as Megatron-LM's main_grad, rather than the paper's 2).

   A ring all-reduce is a reduce-scatter followed by an all-gather, so stages
   1 and 2 communicate what plain data parallelism does (2 Psi per step: the
   gradients reduce-scattered, the updated parameters all-gathered); stage 3
   gathers each unit's parameters twice (before forward, again before
   backward), 3 Psi in all (the paper's section 7).

   Under a pipeline a rank runs M backwards per model chunk, interleaved with other chunks' (pp.py
   wraps all but each chunk's last in no_sync, and the last of a rank's chunks but its final one in
   keep_incomplete_buckets). ZeRO-2 and 3 then keep the chunk's full gradients until its last backward
   and reduce-scatter them once per step (a zero-bubble schedule: after its last weight pass), and
   ZeRO-3 keeps a unit gathered from its first forward to that reduce-scatter (reshard_after_forward
   False): per step one all-gather and one reduce-scatter of Psi, as ZeRO-1's reduce-scatter and
   all-gather. During the step a stage holds its full weights and gradients, as under ZeRO-1; freeing
   a unit after each micro-batch's forward and backward instead would hold only two units whole, for
   2M all-gathers of Psi (and, reducing every backward as well, M reduce-scatters: ZeRO-2's way
   without a pipeline).

   Hybrid sharding (`replicate_group`, see ZeRO1): the shards span a group of N ranks (a node), and R
   such groups hold copies of them: 16/N bytes per parameter under ZeRO-3 for N of the N R ranks, the
   gathers inside the node, and one all-reduce of the shard across the R groups.

4. `clip_grad_norm_`: one global gradient norm over every optimizer (ZeRO's
   or the replicated one), clipping all of them by one factor, as
   torch.nn.utils.clip_grad_norm_ clips one device's gradients.

Nothing here knows the model: the classes take parameters (or a module and
its units) and a process group, so one instance can average dense gradients
over one group and another expert gradients over another.

What a model must offer (the contract for copying this file elsewhere):
nothing but its parameters, and for ZeRO-3 the submodules whose parameters
are gathered together, in forward order. The glue is two lines:
`DataParallel(model.parameters(), group, find_unused_parameters=...)` and
`finish_grad_sync()` before the optimizer step (with `no_sync()` around the
backwards that accumulate). The step, replicated or sharded:

    sync = DataParallel(model.parameters(), group)                    # or AllReduceEveryGradient
    optimizer = ReplicatedOptimizer(model.named_parameters(), torch.optim.AdamW, sync)
    # or: sync = optimizer = ZeRO1(model, group, torch.optim.AdamW)    (ZeRO2, ZeRO3 with units=...)
    loss.backward(); sync.finish_grad_sync()
    clip_grad_norm_([optimizer], 1.0)
    optimizer.step(); optimizer.zero_grad()

Self-check: torchrun --nproc_per_node 4 dp.py
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

# torch 2.13 renamed the flat collectives; older releases only know the old names. (A deliberate copy
# of tp.py's: each dimension file stands alone.)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def broadcast_parameters(params, group=None):
    """Copy the group's first rank's parameters to every rank (replicas start identical)."""
    src = dist.get_global_rank(group or dist.group.WORLD, 0)
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=src, group=group)


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


# ---------------------------------------------------------------------------
# 1. The article's equation: g_avg = 1/N sum_i g_i, for every gradient as it comes
# ---------------------------------------------------------------------------

@contextmanager
def set_within(obj, attribute, value):
    """obj.attribute = value inside the block; afterwards what it was (so an enclosing block's value holds)."""
    previous = getattr(obj, attribute)
    setattr(obj, attribute, value)
    try:
        yield
    finally:
        setattr(obj, attribute, previous)


class AllReduceEveryGradient:
    """Average each gradient over `group` the moment backward has produced it.

    One blocking all-reduce per parameter: backward waits for each, and a
    model of many small tensors pays the collective's latency many times.
    DataParallel below computes the same average without either cost.
    """

    def __init__(self, params, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.n_ranks, self.sync = group, dist.get_world_size(group), True
        broadcast_parameters(self.params, group)
        for p in self.params:
            p.register_post_accumulate_grad_hook(_weakly(self._average))

    def _average(self, p):
        if self.sync:
            dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.n_ranks)

    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this block averages the sum."""
        return set_within(self, "sync", False)

    def finish_grad_sync(self):
        """Nothing to wait for: every average was taken inside backward."""

    @property
    def grads(self):
        """{parameter: its averaged gradient}, as DataParallel's (what ReplicatedOptimizer steps with)."""
        return {p: p.grad for p in self.params}


# ---------------------------------------------------------------------------
# 2. Buckets, reduced while backward goes on (DistributedDataParallel's design)
# ---------------------------------------------------------------------------

class Bucket:
    """A few parameters whose gradients travel together, in one flat buffer.

    The buffer is padded to a multiple of the group size, so that ZeRO can
    give every rank an equal contiguous shard of it.
    """

    def __init__(self, params, n_ranks, allocated=True, grad_dtype=None):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.padded = math.ceil(numel / n_ranks) * n_ranks
        self.offsets, offset = {}, 0
        for p in params:
            self.offsets[p] = offset
            offset += p.numel()
        # The gradients' dtype may be wider than the weights': float32 buckets for bfloat16 weights (see
        # DataParallel), so micro-batches accumulate, and ranks average, in float32.
        self.grad = torch.empty(self.padded, dtype=grad_dtype or params[0].dtype, device=params[0].device)
        self.grad_views = {p: self.view(self.grad, p) for p in params}
        if allocated:
            self.grad.zero_()
        else:  # ZeRO-2 and 3 hold a bucket's full gradient only while backward fills it (see unallocated)
            free_storage(self.grad)
        self.ready = set()     # parameters whose gradient for this step has arrived
        self.launched = False  # its collective has been issued this step
        self.work = None       # the collective in flight

    def view(self, flat, p):
        """p's place inside a flat buffer laid out like this bucket."""
        return flat[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)


def make_buckets(params, bucket_bytes, n_ranks, allocated=True, grad_dtype=None):
    """Group params (already in gradient-arrival order) into buckets of about bucket_bytes of gradients."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size >= bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(Bucket(current, n_ranks, allocated, grad_dtype))
            current, size = [], 0
        current.append(p)
        size += p.numel() * (grad_dtype or p.dtype).itemsize
    if current:
        buckets.append(Bucket(current, n_ranks, allocated, grad_dtype))
    return buckets


class DataParallel:
    """Average the gradients of `params` over `group`, bucket by bucket, overlapped with backward.

    Usage per step:
        for micro_batch in micro_batches[:-1]:
            with dp.no_sync():
                loss(micro_batch).backward()
        loss(micro_batches[-1]).backward()   # all-reduces launch from here
        dp.finish_grad_sync()                 # wait; grads are now averaged
        optimizer.step()

    One gradient's way, method by method:
        p's hook `_on_grad_ready` (at a backward's first gradient it queues `_end_of_backward` with autograd)
        -> `_move_into_bucket`: copied (first micro-batch) or added into p's view (`_grad_view`) of its bucket
        -> its bucket complete: `_launch_ready_buckets` launches the complete ones in order, `_reduce` each:
           an async all-reduce
        -> `_end_of_backward`: `_launch_remaining` launches the rest (a gradient missing here counts as zero)
        -> `finish_grad_sync`: `_wait` each, `_complete` divides; `_keep_used_grads` fills `grads`.
    The ZeRO stages below override:
        ZeRO1  `_reduce`/`_complete`: reduce-scatter into the bucket's `Shard` and divide there; `step`
               steps the shards and all-gathers the weights; a unit's forward hook makes a backward
               through it reduce on every rank (`_before_backward`).
        ZeRO2  `_complete` adds into the shard and frees the bucket, which `_grad_view` allocates again;
               `_reduce` keeps one in flight, `_begin_backward` waits for the previous backward's;
               `between_micro_batches` reduces every backward (no_sync, a pipeline's, defers as above).
        ZeRO3  `_make_buckets`: a bucket per unit; forward pre-hooks and `_before_backward` gather its
               weights (prefetching the next unit's), `_after_forward` (unless a pipeline holds them) and
               `_reduce` free them; `step` gathers nothing.
    Every class's `_across_replicas` is the second reduction of hybrid sharding (ZeRO's, none here).
    """

    def __init__(self, params, group=None, bucket_bytes=25 * 2**20, broadcast=True, divide_by=None,
                 find_unused_parameters=False, reduce_dtype=None):
        self.params = [p for p in params if p.requires_grad]
        self.reduce_dtype = reduce_dtype  # the buckets' (None: the weights'); see _move_into_bucket
        self.group, self.find_unused_parameters = group, find_unused_parameters
        self.n_ranks = dist.get_world_size(group)
        # Gradients are summed over the group, then divided by the number of ranks the loss is averaged
        # over: the group's size, unless (experts) the group is only a part of them.
        self.divide_by = divide_by or self.n_ranks
        self.sync = True                     # False inside no_sync
        self.end_of_backward_queued = False  # the running backward's end will launch what it left
        self.arrived = set()                 # parameters that got a gradient on this rank this step
        self.grads = {}                      # after finish_grad_sync: each parameter's averaged gradient
        self.comm_bytes = Counter()          # bytes this rank sent, per collective kind
        if broadcast:
            broadcast_parameters(self.params, group)
        self.buckets = self._make_buckets(bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        for p in self.params:
            view = self.bucket_of[p].grad_views[p]
            if p.grad is not None:  # a gradient from before
                view.copy_(p.grad)
            p.grad = view if view.dtype == p.dtype else None
            p.register_post_accumulate_grad_hook(_weakly(self._on_grad_ready))

    keeps_full_gradients = True  # between backwards (ZeRO-2 and 3 do not)

    def _make_buckets(self, bucket_bytes):
        return make_buckets(reversed(self.params), bucket_bytes, self.n_ranks, self.keeps_full_gradients,
                            self.reduce_dtype)

    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this block averages them."""
        return set_within(self, "sync", False)

    def between_micro_batches(self):
        """The context for every backward of a step but its last, where no pipeline asks for more: here
        no_sync (the full gradients add up, and are averaged once). ZeRO-2 and 3 choose otherwise."""
        return self.no_sync()

    # -- during backward: each bucket launches when its last gradient arrives --------

    def _on_grad_ready(self, p):
        self._expect_end_of_backward()
        bucket = self.bucket_of[p]
        if self.sync and bucket.launched:  # a second backward since the buckets were reduced
            raise RuntimeError("a gradient arrived after its bucket was reduced: "
                               "wrap all but the last backward of a step in no_sync()")
        self._move_into_bucket(p, self._grad_view(bucket, p))
        self.arrived.add(p)
        if self.sync:
            bucket.ready.add(p)
            self._launch_ready_buckets()

    def _move_into_bucket(self, p, view):
        """p's new gradient into its place in the bucket: its first this step copied, the next micro-batches'
        added.

        Where the bucket is in the weights' dtype, p.grad stays the bucket's view, so that autograd adds
        the next micro-batch's gradient in place (DDP's gradient_as_bucket_view: no copy). A bucket may be
        wider than the weights (reduce_dtype: float32 for bfloat16 weights, as Megatron-LM's main_grad):
        then each bfloat16 gradient is added into it and dropped, so micro-batches accumulate, and ranks
        average, in float32.
        """
        if p.grad is view:  # autograd accumulated into the bucket itself
            return
        if p in self.arrived:
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
        p.grad = view if view.dtype == p.dtype else None

    def _grad_view(self, bucket, p):
        return bucket.grad_views[p]

    def _launch_ready_buckets(self):
        """Launch, in order, the buckets whose gradients have all arrived (on every rank the same order)."""
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket):
        self._reduce(bucket)
        bucket.launched = True
        self.next_to_launch += 1

    def _reduce(self, bucket):
        bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)
        self.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", bucket.grad.nbytes, self.n_ranks)

    # -- at the end of backward: the buckets it left incomplete ------------------------

    def _expect_end_of_backward(self):
        """At a backward's first gradient: queue for its end the launch of what it leaves incomplete."""
        if self.end_of_backward_queued:
            return
        self._begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(_weakly(self._end_of_backward))
        self.end_of_backward_queued = True

    def _begin_backward(self):
        """What a backward does first (ZeRO-2 finishes the previous one's reduction here)."""

    def _end_of_backward(self):
        self.end_of_backward_queued = False
        if self.sync and not self.keep_incomplete:
            self._launch_remaining()

    def _launch_remaining(self, upto=None):
        """Launch every bucket not yet launched (before bucket `upto`); this rank's missing gradients count
        as zero in it."""
        for bucket in self.buckets[self.next_to_launch:upto]:
            for p in bucket.params:
                view = self._grad_view(bucket, p)
                if p not in self.arrived:  # no gradient this step (what the view holds is an older step's)
                    view.zero_()
            self._launch(bucket)

    # -- before the optimizer step: wait, average -----------------------------------

    def finish_grad_sync(self):
        """Launch what backward did not (a backward that had no gradient for these parameters at all),
        wait, average; then self.grads[p] is p's averaged gradient, its bucket's view, or None if no rank
        used p; and p.grad is the same where the bucket is in p's dtype (an optimizer over the parameters
        steps them as DDP's users do), else None (bfloat16 weights: an optimizer over float32 master
        weights takes self.grads)."""
        self._launch_remaining()
        self._wait_all()
        self._keep_used_grads(self._used_somewhere())
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
        bucket.grad.div_(self.divide_by)

    @property
    def averaged_gradients(self):
        """The tensors holding this rank's averaged gradients after finish_grad_sync: the buckets (ZeRO: its
        shards of them)."""
        return [bucket.grad for bucket in self.buckets]

    # -- experts: parameters no rank used keep no gradient ------------------------------

    def _keep_used_grads(self, used_somewhere):
        self.grads = {p: self.bucket_of[p].grad_views[p] if used_somewhere(p) else None for p in self.params}
        for p, grad in self.grads.items():
            p.grad = grad if grad is None or grad.dtype == p.dtype else None

    def _used_somewhere(self):
        """Whether some rank of the group gave p a gradient this step (always, without find_unused_parameters)."""
        if not self.find_unused_parameters:
            return lambda p: True
        mask = torch.tensor([p in self.arrived for p in self.params], dtype=torch.uint8,
                            device=self.params[0].device)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        self.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", mask.numel(), self.n_ranks)
        self._across_replicas(mask, dist.ReduceOp.MAX)
        used = dict(zip(self.params, mask.tolist()))
        return lambda p: used[p]

    def _across_replicas(self, tensor, op=dist.ReduceOp.SUM):
        """Hybrid sharding's second reduction (ZeRO1): nothing here, where `group` holds every replica."""
        return tensor

    # -- pipelines: a rank's model chunks each run a backward of their own --------------

    keep_incomplete = False  # inside keep_incomplete_buckets

    def keep_incomplete_buckets(self):
        """A backward in this block launches the buckets it completes and leaves the others for a later
        backward of the same step (a pipeline rank's model chunks: each has its own last backward)."""
        return set_within(self, "keep_incomplete", True)


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
        self.device = next(iter(self.params.values())).device

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

    def _grads(self):
        """(parameter, its averaged gradient) of those some rank used this step."""
        return [(p, grad) for p, grad in self.grad_sync.grads.items() if grad is not None]

    def squared_norm(self, weights=None):
        """The sum of the squares of the gradients' elements (weighted, see clip_grad_norm_). No collective:
        after data-parallel averaging every replica holds the same gradients."""
        return _weighted_squares(self._grads(), weights, self.device)

    def scale_grads(self, scale):
        for _, grad in self._grads():
            grad.mul_(scale.to(grad.dtype))

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


def _weighted_squares(grads, weights, device):
    """sum over (p, grad) in grads of weights[p] * the sum of grad's squared elements, in float64; a
    parameter not in weights (or weights None) weighs 1."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for p, grad in grads:
        squares += grad.to(torch.float64).square().sum() * (weights.get(p, 1.0) if weights else 1.0)
    return squares


# ---------------------------------------------------------------------------
# 3. ZeRO: each rank keeps 1/N of what data parallelism repeats on every rank
# ---------------------------------------------------------------------------

def free_storage(t):
    """Release t's memory but keep the tensor (and every view of it) for later."""
    t.untyped_storage().resize_(0)


def allocate_storage(t):
    t.untyped_storage().resize_(t.numel() * t.element_size())


def is_allocated(t):
    return t.untyped_storage().nbytes() > 0


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
    the weights, `master`: that place itself, or a copy of its own (master weights wider than the
    weights, float32 for bfloat16, as Megatron-LM's distributed optimizer keeps them; and ZeRO-3's, see
    ZeRO3Shard), copied into `mine` before each all-gather. It steps them as each parameter's piece
    (`pieces`, views of `master`), so that, as on one device, each parameter has its own step count, and
    one that no rank gave a gradient (an expert no token reached) is skipped: its piece's grad is then
    None. The gradient shard `grad` is in the master's dtype.

    This class is stages 1 and 2's: they keep the full parameters, filled from the parameters' values.
    """

    def __init__(self, bucket, rank, n_ranks, values=None, master_dtype=None):
        self.size = bucket.padded // n_ranks
        self.start = rank * self.size
        self.ranges = {}  # parameter: (start, end) of its piece within the shard, for those that have one
        for p in bucket.params:
            lo, hi = max(bucket.offsets[p], self.start), min(bucket.offsets[p] + p.numel(), self.start + self.size)
            if lo < hi:
                self.ranges[p] = (lo - self.start, hi - self.start)
        self.full_params = self._full_params(bucket)
        self.mine = self.full_params[self.start:self.start + self.size]
        self.master = self._master(bucket, values or _elements, master_dtype or self.mine.dtype)
        for p in bucket.params:
            p.data = bucket.view(self.full_params, p)  # the parameter now lives inside the flat buffer
        self.grad = torch.zeros_like(self.master)  # this rank's part of the averaged gradient
        self.reduced = None  # the output of the reduce-scatter in flight
        self.gathering = None  # ZeRO-3: the all-gather of full_params in flight
        self.pieces = {p: self.master[lo:hi] for p, (lo, hi) in self.ranges.items()}
        self.grad_pieces = {p: self.grad[lo:hi] for p, (lo, hi) in self.ranges.items()}
        for p, piece in self.pieces.items():
            piece.grad = self.grad_pieces[p]

    @staticmethod
    def _full_params(bucket):
        """The bucket's weights, flat, holding the parameters' values (the padding zero)."""
        weights = bucket.params[0]
        flat = torch.zeros(bucket.padded, dtype=weights.dtype, device=weights.device)
        for p in bucket.params:
            bucket.view(flat, p).copy_(p.detach())
        return flat

    def _master(self, bucket, values, dtype):
        """The weights the optimizer steps: this rank's place in the full weights, unless wider."""
        return self.mine if dtype == self.mine.dtype else self._own_copy(bucket, values, dtype)

    def _own_copy(self, bucket, values, dtype):
        """This rank's elements of the bucket in `dtype`, each parameter's piece from values(p, start, end):
        its flattened elements [start, end)."""
        mine = torch.zeros(self.size, dtype=dtype, device=self.full_params.device)
        for p, (lo, hi) in self.ranges.items():
            first = self.start - bucket.offsets[p]  # the index in p of the shard's first element
            mine[lo:hi] = values(p, lo + first, hi + first)
        return mine

    def copy_master_into_place(self):
        """The updated master elements into this rank's place in the full weights, in their dtype: what the
        next all-gather sends (nothing to do where the master is that place itself)."""
        if self.master is not self.mine:
            self.mine.copy_(self.master)


class ZeRO3Shard(Shard):
    """ZeRO-3's shard: the full weights exist only while gathered (before a unit's forward and backward),
    so the optimizer steps a master copy of its own, and the flat buffer starts freed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        free_storage(self.full_params)  # (its views, the parameters, were taken above)

    @staticmethod
    def _full_params(bucket):
        weights = bucket.params[0]  # never written: each use gathers it first (see unallocated)
        return torch.empty(bucket.padded, dtype=weights.dtype, device=weights.device)

    def _master(self, bucket, values, dtype):
        return self._own_copy(bucket, values, dtype)


def _elements(p, start, end):
    """Elements [start, end) of a materialised parameter, flattened."""
    return p.detach().reshape(-1)[start:end]


class ZeRO1(DataParallel):
    """ZeRO stage 1 over `group`: the optimizer state sharded; this rank updates only its shards.

    make_optimizer(shards) builds the optimizer (say AdamW) over this rank's
    parameter pieces; it is `self.optimizer`, and `step()` runs it and brings
    every rank's parameters up to date. `units`: submodules holding this
    instance's parameters (for a transformer: embedding, each block, final
    norm, head), in forward order; ZeRO-3 gathers each unit's parameters
    together, and needs them to hold every parameter it shards. A backward
    through a unit ends with this instance's reduction, on a rank whose
    parameters got no gradient in it too, so the ranks reduce alike.

    `params` (default: all of module's) picks the parameters this instance
    shards, so that a mixture of experts can have two: the dense parameters
    over the group of every rank holding different tokens, the experts' over
    the ranks holding the same experts (with divide_by, as in DataParallel).

    Mixed precision (Megatron-LM's distributed optimizer, FSDP2's policy): with
    weights in bfloat16, `master_dtype=torch.float32` keeps this rank's shard of
    the weights in float32 beside them, and the optimizer (so AdamW's moments)
    works on it; `reduce_dtype` (default: the master's) is the gradients'
    while they are reduced. What is gathered is the weights, in their dtype.
    initial_values(name, shape, start, end), where given, fills a shard kept
    apart from the weights (see ZeRO3) with elements [start, end) of the
    flattened parameter `name` (of this rank's `shape`), instead of taking
    them from the weights, which may have been rounded to bfloat16.

    Hybrid sharding (FSDP's HSDP, torchtitan's replicate x shard, DeepSpeed's MiCS): `group` may be only
    part of the ranks that average these gradients, the rest holding copies of the same shards in groups
    of their own, and `replicate_group` the ranks holding this rank's copy (one per shard group). A node
    on GPUs is a good shard group: the all-gathers (every layer's, under ZeRO-3) and the reduce-scatters
    stay on its fast links, and what crosses nodes is one all-reduce of each shard per step (2 (R-1)/R of
    Psi/N over R replicas, instead of the shard group's (N-1)/N Psi of each collective). Each shard
    group's reduce-scatter sums its own ranks' gradients; the all-reduce over the replicas then sums the
    shard over every rank, and the division is by all of them (divide_by, by default N times R).

    Usage per step:
        loss.backward()          # reduce-scatters launch from here
        zero.finish_grad_sync()  # this rank's shard of the averaged gradient
        clip_grad_norm_([zero], 1.0)
        zero.step()
        zero.zero_grad()
    """

    shard_type = Shard  # ZeRO-3's: ZeRO3Shard

    def __init__(self, module, group, make_optimizer, units=(), bucket_bytes=25 * 2**20, broadcast=True,
                 params=None, divide_by=None, find_unused_parameters=False, master_dtype=None, reduce_dtype=None,
                 initial_values=None, replicate_group=None):
        params = list(module.parameters() if params is None else params)
        mine = set(map(id, params))
        self.units = [unit for unit in units if any(id(p) in mine for p in unit.parameters())]
        self.names = {p: name for name, p in module.named_parameters()}
        self.replicate_group = replicate_group
        self.n_replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        super().__init__(params, group, bucket_bytes, broadcast, divide_by or dist.get_world_size(group) *
                         self.n_replicas, find_unused_parameters, reduce_dtype or master_dtype)
        if broadcast and replicate_group is not None:  # every shard group starts from the same weights
            broadcast_parameters(self.params, replicate_group)
        self.rank = dist.get_rank(group)
        values = initial_values and (lambda p, start, end: initial_values(self.names[p], p.shape, start, end))
        self.shards = {bucket: self.shard_type(bucket, self.rank, self.n_ranks, values, master_dtype)
                       for bucket in self.buckets}
        self.optimizer = make_optimizer([piece for shard in self.shards.values() for piece in shard.pieces.values()])
        for i, unit in enumerate(self.units):
            unit.register_forward_hook(partial(self._after_forward, i))

    @property
    def param_shards(self):
        return [shard.master for shard in self.shards.values()]

    @property
    def grad_shards(self):
        return [shard.grad for shard in self.shards.values()]

    averaged_gradients = grad_shards

    # -- gradients: reduce-scatter instead of all-reduce (a ring all-reduce's first half) ----------

    def _reduce(self, bucket):
        shard = self.shards[bucket]
        shard.reduced = torch.empty(shard.size, dtype=bucket.grad.dtype, device=bucket.grad.device)
        bucket.work = reduce_scatter_flat(shard.reduced, bucket.grad, group=self.group, async_op=True)
        self.comm_bytes["reduce_scatter"] += ring_bytes_sent("reduce_scatter", bucket.grad.nbytes, self.n_ranks)

    def _complete(self, bucket):
        shard = self.shards[bucket]
        # (the full gradients summed the micro-batches)
        shard.grad.copy_(self._across_replicas(shard.reduced).div_(self.divide_by))
        shard.reduced = None

    def _across_replicas(self, tensor, op=dist.ReduceOp.SUM):
        """Hybrid sharding: a shard's sum over this shard group, summed over the shard groups (blocking, once
        the reduce-scatter is done; the same order of collectives on every rank)."""
        if self.replicate_group is not None:
            dist.all_reduce(tensor, op=op, group=self.replicate_group)
            self.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", tensor.nbytes, self.n_replicas)
        return tensor

    def _keep_used_grads(self, used_somewhere):
        super()._keep_used_grads(used_somewhere)
        self._keep_used_pieces(used_somewhere)

    def _keep_used_pieces(self, used_somewhere):
        for shard in self.shards.values():
            for p in shard.pieces:
                shard.pieces[p].grad = shard.grad_pieces[p] if used_somewhere(p) else None

    def zero_grad(self):
        for bucket, shard in self.shards.items():
            shard.grad.zero_()
            bucket.grad.zero_()

    def _after_forward(self, i, module, args, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i):
        # A backward through a unit reduces this instance's buckets at its end, on every rank, even where
        # none of them got a gradient (experts no token reached here, and reached on another rank).
        self._expect_end_of_backward()

    # -- optimizer step on the shards, then the parameters all-gathered (the all-reduce's second half) --

    def scale_grads(self, scale):
        for g in self.grad_shards:
            g.mul_(scale.to(g.dtype))

    def squared_norm(self, weights=None):
        """The sum of the squares of this instance's gradient elements over its group (weighted, see
        clip_grad_norm_): one scalar all-reduce, the shards being disjoint, so each element counts once
        (hybrid sharding: over the shard group alone, whose replicas hold the same shards)."""
        pieces = [(p, piece) for shard in self.shards.values()
                  for p, piece in shard.grad_pieces.items()]  # (the padding holds no gradient)
        squares = _weighted_squares(pieces, weights, self.buckets[0].grad.device)
        dist.all_reduce(squares, group=self.group)
        self.comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", squares.element_size(), self.n_ranks)
        return squares

    def step(self):
        """Update this rank's shards, then all-gather the new parameters."""
        self.optimizer.step()
        works = [self._all_gather(bucket) for bucket in self.buckets]
        for work in works:
            work.wait()

    def _all_gather(self, bucket):
        """Every rank's shard of the bucket's weights into full_params, in the weights' dtype (bfloat16 under
        mixed precision: half of float32's traffic)."""
        shard = self.shards[bucket]
        shard.copy_master_into_place()
        self.comm_bytes["all_gather"] += ring_bytes_sent("all_gather", shard.full_params.nbytes, self.n_ranks)
        return all_gather_flat(shard.full_params, shard.mine, group=self.group, async_op=True)

    @contextmanager
    def full_parameters(self):
        """Every parameter in full for the duration (stages 1 and 2 always hold them)."""
        yield

    # -- what a checkpoint saves of this rank: its piece of each parameter ---------------------------

    def pieces(self):
        """(name, start, end, piece) of each parameter this rank updates a piece of: elements [start, end)
        of the flattened parameter `name`, whose optimizer state is self.optimizer.state[piece]. A
        checkpoint saves them, each rank its own, and fills them again under any layout."""
        for bucket, shard in self.shards.items():
            for p, (lo, hi) in shard.ranges.items():
                first = shard.start - bucket.offsets[p]  # the index in p of the shard's first element
                yield self.names[p], lo + first, hi + first, shard.pieces[p]

    def gradient_pieces(self):
        """(name, start, end, averaged gradient or None) of each piece of pieces(), once the gradients are
        synchronised and before the step (what a parity check compares with one device)."""
        for name, start, end, piece in self.pieces():
            yield name, start, end, piece.grad


class ZeRO2(ZeRO1):
    """ZeRO stage 2: ZeRO-1, and the gradients sharded too.

    No full gradient is kept between steps: a backward reduce-scatters its
    buckets (one in flight at a time) and frees them, and the shard
    accumulates. Between the micro-batches of a step there are two ways:
    - `between_micro_batches()` (gradient accumulation, no pipeline): every
      backward reduces, so no full gradient outlives a backward (the paper's
      memory, for M reductions of M micro-batches); a backward through any
      unit then reduces every bucket on every rank (zeros where it brought no
      gradient), so the collectives stay in step;
    - `no_sync()` (DataParallel's, FSDP2's set_requires_gradient_sync(False);
      what a pipeline asks for): the full gradients add up in their buckets
      until the backward outside it, which reduces them once (ZeRO-1's memory
      during the step, one reduction per step; the buckets freed after it).
    """

    keeps_full_gradients = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.params:
            p.grad = None

    def between_micro_batches(self):
        return nullcontext()  # reduce-scatter every backward

    def _begin_backward(self):
        if self.next_to_launch == len(self.buckets):  # the previous backward's reduction, finished alike
            self._wait_all()

    def _grad_view(self, bucket, p):
        if not is_allocated(bucket.grad):  # freed after the previous reduce-scatter
            allocate_storage(bucket.grad)
            bucket.grad.zero_()
        return bucket.grad_views[p]

    def _reduce(self, bucket):
        for earlier in self.buckets[:self.next_to_launch]:  # one full gradient bucket in flight at a time
            self._wait(earlier)
        super()._reduce(bucket)
        for p in bucket.params:  # the next backward must not accumulate into a buffer being reduced
            p.grad = None

    def _complete(self, bucket):
        shard = self.shards[bucket]
        shard.grad.add_(self._across_replicas(shard.reduced).div_(self.divide_by))  # the shard accumulates
        shard.reduced = None
        free_storage(bucket.grad)

    def _keep_used_grads(self, used_somewhere):
        self._keep_used_pieces(used_somewhere)  # no full gradient: the shards hold them

    def zero_grad(self):
        for shard in self.shards.values():
            shard.grad.zero_()


class ZeRO3(ZeRO2):
    """ZeRO stage 3 (FSDP): ZeRO-2, and the parameters sharded too.

    A unit's parameters exist in full only while it computes: all-gathered
    before its forward (the next unit's gather prefetched, overlapping this
    one's compute), freed after it, gathered again before its backward, and
    freed once its gradients are reduce-scattered. Each unit is one bucket.

    Under a pipeline (`reshard_after_forward=False`, FSDP2's flag, as torchtitan sets it under pipeline
    parallelism) a unit stays gathered from its first forward of the step to its reduce-scatter, after
    the last backward (no_sync defers it, see ZeRO2): one all-gather and one reduce-scatter per unit and
    step, where freeing after every forward and backward would gather 2M times for M micro-batches. The
    stage's units are then whole, with their full gradients, through the step's backwards, as under
    ZeRO-1; what ZeRO-3 saves there is memory outside them: from the reduce-scatter to the next step's
    forwards (the optimizer's step, checkpoints, evaluation, whose forwards free as they go) a rank
    holds its shards alone.

    initial_values (see ZeRO1), for a model whose parameters were given no memory yet (built on the
    meta device, then `unallocated`): only this rank's shards are then made and filled, so no rank
    ever holds a whole parameter it shards. Without it, the shards are cut from the parameters' values.
    """

    shard_type = ZeRO3Shard

    def __init__(self, module, group, make_optimizer, units=(), reshard_after_forward=True, **options):
        if not units:
            raise ValueError("ZeRO-3 needs the units whose parameters are gathered together")
        self.reshard_after_forward = reshard_after_forward
        super().__init__(module, group, make_optimizer, units, **options)
        self.unit_buckets = self.buckets[::-1]  # buckets are in backward order, units in forward order
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(partial(self._before_forward, i))

    def _make_buckets(self, bucket_bytes):
        mine = set(map(id, self.params))
        params = [[p for p in unit.parameters() if id(p) in mine] for unit in self.units]
        covered = [p for unit_params in params for p in unit_params]
        if sorted(map(id, covered)) != sorted(mine):
            raise ValueError("ZeRO-3 units must hold every parameter this instance shards exactly once")
        return [Bucket(unit_params, self.n_ranks, False, self.reduce_dtype) for unit_params in reversed(params)]

    def _before_forward(self, i, module, args):
        self._gather(i)
        self._prefetch(i + 1)  # the next unit's gather overlaps this unit's compute

    def _after_forward(self, i, module, args, output):
        if self.reshard_after_forward or not torch.is_grad_enabled():  # (no backward follows a no_grad forward)
            self._free_params(self.unit_buckets[i])
        super()._after_forward(i, module, args, output)

    def _before_backward(self, i):
        super()._before_backward(i)
        if self.sync and self.find_unused_parameters:  # the units after this one are done: reduce them (below)
            self._launch_remaining(upto=len(self.buckets) - 1 - i)
        self._gather(i)        # backward needs the weights again,
        self._prefetch(i - 1)  # and the unit before this one comes next

    def _launch_ready_buckets(self):
        # ZeRO-3 gathers units during backward, so its reduce-scatters must come at the same place among
        # those gathers on every rank. When some rank may get no gradient for a unit (an expert no token
        # reached there), a unit's reduction cannot wait for its gradients: it is launched when backward
        # reaches the unit before it (and the first unit's at the end of backward), on every rank alike.
        if not self.find_unused_parameters:
            super()._launch_ready_buckets()

    def _reduce(self, bucket):
        super()._reduce(bucket)
        self._free_params(bucket)  # all its gradients have arrived: its backward is over

    def step(self):
        """Update this rank's shards; the parameters are gathered just in time, at the next forward."""
        self.optimizer.step()

    def _prefetch(self, i):
        if not 0 <= i < len(self.unit_buckets):
            return
        bucket = self.unit_buckets[i]
        shard = self.shards[bucket]
        if is_allocated(shard.full_params):  # gathered, or being gathered
            return
        allocate_storage(shard.full_params)
        shard.gathering = self._all_gather(bucket)

    def _gather(self, i):
        self._prefetch(i)
        self._wait_for_gather(self.shards[self.unit_buckets[i]])

    def _free_params(self, bucket):
        shard = self.shards[bucket]
        self._wait_for_gather(shard)
        free_storage(shard.full_params)

    @staticmethod
    def _wait_for_gather(shard):
        if shard.gathering is not None:
            shard.gathering.wait()
            shard.gathering = None

    @contextmanager
    def full_parameters(self):
        """Every parameter gathered for the duration, e.g. to gather the whole model (tests, tools)."""
        for i in range(len(self.unit_buckets)):
            self._gather(i)
        try:
            yield
        finally:
            for bucket in self.buckets:
                self._free_params(bucket)


ZERO_STAGES = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


def gpt_units(model):
    """ZeRO-3 units of model.py's GPT, in forward order (the only model knowledge in this file)."""
    units = [model.tok_emb, model.pos_emb, *model.blocks, model.norm, model.lm_head]
    return [unit for unit in units if unit is not None]  # no position table with rotary embeddings


# ---------------------------------------------------------------------------
# 4. Clipping: one norm of the whole model's gradient, whatever holds it
# ---------------------------------------------------------------------------

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
    squares = sum(optimizer.squared_norm(weights) for optimizer in optimizers)
    for group in groups:
        dist.all_reduce(squares, group=group)
    total_norm = squares.sqrt()
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for optimizer in optimizers:
        optimizer.scale_grads(scale)
    return total_norm


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node N dp.py
# ---------------------------------------------------------------------------

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
