"""Pipeline parallelism: layers split into stages, micro-batches scheduled through them.

The article's section "Pipeline Parallelism" ("5D Parallelism from Scratch"), its assembly line: P ranks
each hold a contiguous slice of the layers (rank 0 also the embedding, rank P-1 the head and the loss); a
micro-batch's activations flow forward stage to stage, its gradients back. With M micro-batches a stage
idles the fraction (GPipe's bubble overhead, `bubble_formula`)

    bubble = (P - 1) / (M + P - 1)          (article: 3/4 for P=4, M=1; 1/5 for M=12)

A schedule is a flat list of this rank's ("forward" | "backward", chunk, micro-batch) actions: the
article's GPipe (Huang et al., 2019) and 1F1B (Narayanan et al., 2019, "PipeDream", flushed each step as
in PipeDream-Flush, 2021). `run_schedule` places every rank's actions on common time steps, which fix
the order of every message. After the banner: interleaved 1F1B (Megatron-LM, V chunks a rank), ZB-H1 and
ZB-V (Qi et al., 2023, 2024: B now, W deferred), combined 1F1B (a forward and a backward `Paired`, taking
turns at the experts' all-to-alls), `Placement`, measuring; docs/pipeline-schedules.md.

Copying this file alone (the contract). The model offers, for each chunk this rank holds, a callable
that runs a contiguous slice of its layers (token ids in on the first chunk, logits out on the last,
activations of one fixed `shape` in between; it may return (output, side_loss)), and a loss function of
(output, targets). A micro-batch is (inputs, targets, *rest): the rest goes to every chunk after its
input (model.py's packed documents). The glue, about ten lines (`GPTChunk` is model.py's):

    schedules = [make_schedule(name, M, P, r) for r in range(P)]
    losses, side_losses = run_schedule(schedules, chunks, micro_batches, loss_fn, group, shape, dtype, device)

`chunks` lists this rank's model chunks (of `split_layers(n_layers, V*P)`) in the order of
`schedules[rank].placement.model_chunks(rank)`: one a rank for GPipe, 1F1B and ZB-H1 (rank r: chunk r);
interleaved, a loop (rank r: chunks r, r+P, r+2P, ...); ZB-V, a V (rank r: chunks r and 2P-1-r, so rank
0 holds the first and the last). make_schedule's lists carry that placement and run_schedule runs on it;
a different `placement=` is refused up front, and so is a V listed by hand without
`placement=Placement.of("zbv", P, 2)`. `forward_only`'s lists (evaluation) carry none: pass
run_schedule the training schedules' `placement=`.

Self-check: torchrun --nproc_per_node 4 pp.py
"""
import os
import threading
import time
from collections import defaultdict, deque
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import GradientEdge


def split_layers(n_layers, n_model_chunks):
    """Layer ranges of each model chunk, as even as possible (earlier chunks get the extra layers)."""
    if n_layers < n_model_chunks:
        raise ValueError(f"{n_layers} layers cannot fill {n_model_chunks} pipeline chunks "
                         f"(pp x virtual stages) of at least one layer each")
    per_chunk, extra = divmod(n_layers, n_model_chunks)
    bounds = [0]
    for chunk in range(n_model_chunks):
        bounds.append(bounds[-1] + per_chunk + (chunk < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(n_model_chunks)]


def bubble_formula(n_stages, n_micro, n_chunks=1, schedule=None):
    """The ideal idle fraction of a stage: the article's (P-1) / (M + P-1), GPipe's bubble overhead and
    1F1B's. With V chunks a rank (interleaved 1F1B, V = n_chunks) Megatron-LM's (P-1) / (V*M + P-1); the
    zero-bubble schedules' own (`schedule`, after the banner: `ZERO_BUBBLES`)."""
    if schedule in ZERO_BUBBLES:
        return ZERO_BUBBLES[schedule](n_stages, n_micro)
    return (n_stages - 1) / (n_chunks * n_micro + n_stages - 1)


# ---------------------------------------------------------------------------
# Schedules: what this rank does, in order (GPipe, 1F1B)
# ---------------------------------------------------------------------------

def gpipe(n_micro, n_stages, rank):
    """All forwards, then all backwards (GPipe, "all forward all backward"): every micro-batch's activations
    are alive at once, M of them."""
    return ([("forward", 0, m) for m in range(n_micro)] +
            [("backward", 0, m) for m in range(n_micro)])


def one_f_one_b(n_micro, n_stages, rank):
    """1F1B: warm-up forwards, then alternate one forward and one backward, then cool-down backwards. Each
    backward frees a micro-batch's activations, so at most P - rank are alive, for GPipe's bubble."""
    warmup = min(n_stages - rank - 1, n_micro)
    actions = [("forward", 0, m) for m in range(warmup)]                     # warm-up
    for m in range(n_micro - warmup):                                         # steady state
        actions += [("forward", 0, warmup + m), ("backward", 0, m)]
    actions += [("backward", 0, m) for m in range(n_micro - warmup, n_micro)]  # cool-down
    return actions


# ---------------------------------------------------------------------------
# Messages, and the time steps that make their order the same on both sides
# ---------------------------------------------------------------------------

def message_needed(action, rank, placement):
    """The message `action` on `rank` must receive before it runs, or None.

    A message is named (kind, model chunk that sent it, micro-batch): a forward of model chunk k needs
    the activation of chunk k-1, a backward the gradient of chunk k+1 (the first chunk reads tokens,
    the last chunk's backward starts from the loss).
    """
    kind, c, m = action
    k = placement.model_chunks(rank)[c]
    if kind == "forward" and k > 0:
        return ("activation", k - 1, m)
    if kind == "backward" and k < placement.n_model_chunks - 1:
        return ("gradient", k + 1, m)
    return None


def message_sent(action, rank, placement):
    """(destination rank, message) that `action` on `rank` sends when it is done, or None: to the holder of
    the next model chunk (a forward's activation) or of the previous one (a backward's gradient)."""
    kind, c, m = action
    k = placement.model_chunks(rank)[c]
    if kind == "forward" and k < placement.n_model_chunks - 1:
        return placement.holder(k + 1)[0], ("activation", k, m)
    if kind == "backward" and k > 0:
        return placement.holder(k - 1)[0], ("gradient", k, m)
    return None


def timeline(schedules, placement=None):
    """Every rank's actions on common time steps: steps[t][r] is what rank r runs at step t (None: idle).

    schedules[r] is rank r's action list; placement says where the chunks are (default: the one the
    schedules carry, else one a rank). At each step a rank runs its next action if the message it needs was
    sent at an earlier step, and idles otherwise. The result is the pipeline diagram of the article (one row
    per stage, one column per step), and it fixes the order of every message.
    """
    n_stages = len(schedules)
    placement = placement or getattr(schedules[0], "placement", None) or Placement(n_stages)
    position, sent_at, steps = [0] * n_stages, {}, []
    while any(position[r] < len(schedules[r]) for r in range(n_stages)):
        t, row = len(steps), []
        for r, actions in enumerate(schedules):
            action = actions[position[r]] if position[r] < len(actions) else None
            needs = [message_needed(half, r, placement) for half in halves(action)]
            ready = action is not None and all(need is None or sent_at.get(need, t) < t for need in needs)
            row.append(action if ready else None)
            position[r] += ready
        if not any(row):
            raise placement.deadlock(schedules, t)
        for r, action in enumerate(row):
            for out in messages_sent(action, r, placement):
                sent_at[out[1]] = t
        steps.append(row)
    return steps


def exchanges(steps, rank, placement=None):
    """What this rank posts after each step: ([(destination, message)], [(source, message)]).

    After step t every rank posts, as one batch, the message its own action of step t sends and the receives
    of the messages its neighbours' actions of step t send it. The two ends of a message are thus always in
    the batch of the same step, which is what NCCL needs. NCCL ignores tags: between two ranks, sends and
    receives match in posting order, and here both sides post their messages in step order, so they match by
    that order alone. And NCCL runs the batches of one communicator one after the other on one stream, so a
    receive posted early would block every send queued behind it (with 1F1B on two stages, a first stage
    waiting for a gradient before sending the activation that the second stage needs to produce it). Here
    batch t can complete as soon as every rank has finished step t, and step t waits only for batches before
    t, so nothing deadlocks. A message from a rank to itself (the turn of a V, from chunk P-1 to chunk P on
    rank P-1) is listed on both sides too; `_P2P` hands it over without posting it.
    """
    n_stages = len(steps[0])
    placement = placement or Placement(n_stages)
    posted = []
    for row in steps:
        sent = [messages_sent(a, r, placement) for r, a in enumerate(row)]
        receives = [(source, out[1]) for source, outs in enumerate(sent) for out in outs if out[0] == rank]
        posted.append((sent[rank], receives))
    return posted


class _Batch:
    """The works of one `batch_isend_irecv`, waited for once: a receive needs its whole batch (NCCL
    gives one work for a batch, whose operations run as one group), and waiting twice on gloo's
    receive waits for a second message."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []

    def waiter(self, buffer):
        def wait():
            self.wait()
            return buffer
        return wait


# ---------------------------------------------------------------------------
# The executor: every rank walks one timeline, computing its actions and exchanging their messages
# ---------------------------------------------------------------------------

def run_schedule(schedules, chunks, micro_batches, loss_fn, group, shape, dtype, device, *,  # beyond the article:
                 grad_sync=None, stats=None, debug=False, forward_context=nullcontext, placement=None):
    """Execute this rank's actions; returns (losses, side_losses) as floats.

    schedules: every rank's action list (schedules[r] for pipeline rank r); all ranks place them on the same
    time steps (`timeline`), which orders their messages.
    chunks: this rank's model chunks, callables x -> y or (y, side_loss), in the order of
    placement.model_chunks(rank).
    placement: where the model chunks are (a `Placement`); by default the one the schedules were written for
    (make_schedule's lists carry it: ZB-V's is a V), else a loop (chunk c of rank r is model chunk c*P + r).
    micro_batches: (inputs, targets, *rest) each; the first chunk reads inputs, the last targets, and every
    chunk takes the rest after its input (model.py's packed documents: their ids).
    loss_fn(output, targets): the loss of one micro-batch; gradients average over micro-batches.
    losses: of each micro-batch, on the rank holding the last chunk (elsewhere []). side_losses: of each
    (chunk, micro-batch) whose chunk returned one (an MoE layer's load-balancing loss), on the rank that
    computed it: its gradient flows from there, so no rank has to hold every rank's side losses.
    Without backward actions this is an inference pass. Beyond the article: `placement` above; grad_sync, a
    data-parallel wrapper with no_sync() and keep_incomplete_buckets(): each chunk's gradients are reduced
    during its last gradient sum, once per step (`_ReductionPlan`); stats, a `PipelineStats` to measure
    into; forward_context, entered around every forward (activation counting); debug, each message logged.
    """
    n_stages, rank = dist.get_world_size(group), dist.get_rank(group)
    placement = Placement.to_run(schedules[rank], placement, n_stages, len(chunks))  # (one a rank: rank r, chunk r)
    actions, stats = schedules[rank], stats or PipelineStats(device)
    # Chosen once: a schedule with weight actions (ZB-H1, ZB-V) splits each backward into B and W.
    Stage = _SplitBackward if any(kind == "weight" for kind, _, _ in every_half(actions)) else _WholeBackward
    reduction = _ReductionPlan(actions, Stage.summing, grad_sync, chunks)  # when data parallelism reduces
    is_last = [k == placement.n_model_chunks - 1 for k in placement.model_chunks(rank)]
    stage = Stage(chunks, micro_batches, loss_fn, forward_context, reduction, is_last, stats)
    p2p = _P2P(group, shape, dtype, device, debug or os.environ.get("PP_DEBUG") == "1")
    steps, received = timeline(schedules, placement), {}
    if stats.actions is not None:  # a timeline is recorded: the stages start it together
        dist.barrier(group=group)
    start = stats.origin = stats.total.now()
    # Every rank walks the same steps and posts after each the batch `exchanges` lists: both ends of a
    # message in the same step's batch, which is why the messages match and nothing deadlocks on NCCL.
    for row, (sends, receives) in zip(steps, exchanges(steps, rank, placement)):
        action, outputs = row[rank], {}  # None: this rank idles this step (but still posts its receives)
        if action:
            # (1) wait for the input messages: a forward's activation, a backward's gradient (if any)
            needs = [message_needed(half, rank, placement) for half in halves(action)]
            waiting = stats.wait.now()
            incoming = [received.pop(need)() if need else None for need in needs]
            # (2) compute
            computing = stats.compute.now()
            with torch.profiler.record_function(f"pp.{action_name(action)}"):
                outputs = dict(zip(halves(action), stage.run(action, incoming)))  # (a profiler's trace names the range)
            done = stats.compute.now()
        # (3) post this step's sends (this action's output) and receives (what the neighbours' actions send)
        produced = {message_sent(half, rank, placement): output for half, output in outputs.items()}
        received.update(p2p.post([(peer, message, produced[peer, message]) for peer, message in sends], receives))
        # (4) record timing
        if action:
            stats.record(action, waiting, computing, done)
    p2p.flush()
    stats.total.add(start, stats.total.now())
    stats.bytes_sent += p2p.bytes_sent
    return [loss.item() for loss in stage.losses], [side.item() for side in stage.side_losses]


class _Stage:
    """This rank's model chunks, running its actions. A subclass says how a backward runs: whole, or split.

    `saved` holds, per (chunk, micro-batch), what its backward needs, from its forward on; with a split
    backward, then what its weight pass has left to do. Its size is the activation memory in micro-batches.
    """

    summing = None  # the kind of action that sums the weights' gradients (each subclass names it)

    def __init__(self, chunks, micro_batches, loss_fn, forward_context, reduction, is_last, stats):
        self.chunks, self.micro_batches, self.loss_fn = chunks, micro_batches, loss_fn
        self.forward_context, self.reduction, self.stats = forward_context, reduction, stats
        self.is_last = is_last  # is_last[c]: chunk c is the model's last (it computes the loss)
        self.saved, self.losses, self.side_losses = {}, [], []

    def run(self, action, incoming):
        """Compute `action` from the messages its halves received (None where one needs none); returns what each
        half sends (None: nothing)."""
        if len(halves(action)) > 1:  # (after the banner: a forward and a backward Paired, which runs itself)
            return action.run(self, incoming)
        kind, c, m = action
        if kind == "forward":
            return [self.forward(c, m, *incoming)]
        if kind == "backward":
            return [self.backward(c, m, *incoming)]
        return [self.weight(c, m)]

    def forward(self, c, m, activation):
        """Chunk c on micro-batch m, from the previous chunk's activation (the first chunk reads the inputs);
        returns its output, and keeps what its backward needs."""
        last = self.is_last[c]
        x = self.micro_batches[m][0] if activation is None else activation.requires_grad_()
        with self.forward_context():  # the losses too (activation counting)
            y = self.chunks[c](x, *self.micro_batches[m][2:])  # and what else it takes (packed documents)
            y, side = y if isinstance(y, tuple) else (y, None)
            roots = self._loss_roots(m, side, y if last else None)
        if torch.is_grad_enabled():  # not an inference pass
            self.saved[c, m] = (x, None if last else y, roots)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.saved))
        return y

    def _loss_roots(self, m, side, last_output):
        """The losses backward starts from, each micro-batch's share of them (the mean over micro-batches, as
        gradient accumulation does): a side loss on any stage, the loss of the last chunk's output."""
        roots = []
        if side is not None:
            self.side_losses.append(side.detach())
            roots.append(side / len(self.micro_batches))
        if last_output is not None:
            loss = self.loss_fn(last_output, self.micro_batches[m][1])
            self.losses.append(loss.detach())
            roots.append(loss / len(self.micro_batches))
        return roots

    def _backward_start(self, c, m, grad):
        """(input, roots, their gradients) for the backward of chunk c on micro-batch m: its losses (gradient
        None, autograd's 1) and, below the last chunk, its output with the gradient the next chunk sent."""
        x, y, roots = self.saved.pop((c, m))
        grads = [None] * len(roots)
        if grad is not None:
            roots, grads = [y, *roots], [grad, *grads]
        return x, roots, grads


class _WholeBackward(_Stage):
    """A backward action computes the input's and the weights' gradients in one pass, summing the latter."""

    summing = "backward"

    def backward(self, c, m, grad):
        """Returns the gradient of the chunk's input."""
        x, roots, grads = self._backward_start(c, m, grad)
        with self.reduction.context(("backward", c, m)):
            torch.autograd.backward(roots, grads)
        return x.grad


class _P2P:
    """Point-to-point with the other stages: one batch of sends and receives posted after each step. A message
    to this rank itself (the turn of a V) is handed over as it is: a tensor detached from the graph that made
    it, as a received one would be."""

    def __init__(self, group, shape, dtype, device, debug):
        self.group, self.shape, self.dtype, self.device, self.debug = group, shape, dtype, device, debug
        self.rank = dist.get_rank(group)
        self.batches = []  # every batch posted; those no receive needed are waited for at the end
        self.bytes_sent = 0

    def post(self, sends, receives):
        """Post one batch; returns {message: a function that waits for it and gives the tensor}."""
        ops, buffers, handed_over = [], {}, {}
        for peer, message, tensor in sends:
            tensor = tensor.detach().to(self.dtype).contiguous()
            if peer == self.rank:
                handed_over[message] = (lambda tensor: lambda: tensor)(tensor)  # a waiter with nothing to wait for
                continue
            ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), self.group))
            self.bytes_sent += tensor.numel() * tensor.element_size()
            self._log(f"send {message} to stage {peer}")
        for peer, message in receives:
            if peer == self.rank:
                continue
            buffers[message] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffers[message], self._global(peer), self.group))
            self._log(f"post receive of {message} from stage {peer}")
        if not ops:
            return handed_over
        batch = _Batch(dist.batch_isend_irecv(ops))
        self.batches.append(batch)
        return {**handed_over, **{message: batch.waiter(buffer) for message, buffer in buffers.items()}}

    def flush(self):
        for batch in self.batches:
            batch.wait()
        self.batches = []

    def _global(self, peer):
        return dist.get_global_rank(self.group or dist.group.WORLD, peer)

    def _log(self, message):
        if self.debug:
            print(f"[pp stage {dist.get_rank(self.group)}] {message}", flush=True)


# ---------------------------------------------------------------------------
# An action's halves: itself, or (after the banner) a forward and a backward run together
# ---------------------------------------------------------------------------

def halves(action):
    """What a step's action runs: itself; nothing for an idle step (None); or, after the banner, the forward
    and the backward of a `Paired` action (which says so)."""
    return () if action is None else getattr(action, "halves", (action,))


def every_half(actions):
    """A rank's actions, each paired one as its two halves (forward first)."""
    return [half for action in actions for half in halves(action)]


def messages_sent(action, rank, placement):
    """[(destination rank, message)] of what an action's halves send."""
    return [out for out in (message_sent(half, rank, placement) for half in halves(action)) if out]


def action_name(action):
    """How a trace names a step's action: `forward chunk 0 micro 3`, a pair's halves joined by `+`."""
    return " + ".join(f"{kind} chunk {c} micro {m}" for kind, c, m in halves(action))


# ---- Beyond the article ----

# ---------------------------------------------------------------------------
# The other schedules: interleaved 1F1B, ZB-H1, ZB-V, and schedules by name
# ---------------------------------------------------------------------------

def virtual_step(k, n_stages, n_chunks, forward=True):
    """(chunk, micro-batch) of a rank's k-th forward (or backward) under interleaving.

    Micro-batches go in groups of P: the first P forwards run micro-batches
    0..P-1 through chunk 0, the next P through chunk 1, and so on, then the
    next group; backwards walk the chunks in reverse.
    """
    chunk = (k % (n_stages * n_chunks)) // n_stages
    micro = (k // (n_stages * n_chunks)) * n_stages + k % n_stages
    return (chunk if forward else n_chunks - 1 - chunk), micro


def interleaved_1f1b(n_micro, n_stages, rank, n_chunks):
    """Megatron-LM's interleaved 1F1B over V = n_chunks virtual stages a rank, placed in a loop (rank r holds
    model chunks r, r+P, r+2P, ...): a micro-batch visits every rank V times, and the bubble shrinks by V
    for V times the point-to-point messages."""
    if n_stages < 2:
        raise ValueError("interleaved 1F1B needs at least two pipeline stages")
    if n_micro % n_stages:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({n_micro}) to be a multiple of "
                         f"the pipeline size ({n_stages})")
    total = n_micro * n_chunks
    chunk = lambda k, forward: virtual_step(k, n_stages, n_chunks, forward)[0]  # noqa: E731
    micro = lambda k: virtual_step(k, n_stages, n_chunks)[1]  # noqa: E731
    warmup = min((n_stages - rank - 1) * 2 + (n_chunks - 1) * n_stages, total)
    actions = [("forward", chunk(k, True), micro(k)) for k in range(warmup)]              # warm-up
    for k in range(total - warmup):                                                      # steady state
        actions += [("forward", chunk(warmup + k, True), micro(warmup + k)), ("backward", chunk(k, False), micro(k))]
    actions += [("backward", chunk(k, False), micro(k)) for k in range(total - warmup, total)]  # cool-down
    return actions


def zero_bubble_h1(n_micro, n_stages, rank):
    """ZB-H1: 1F1B's order with B as the backward; each W deferred while this rank holds fewer than `rank`
    others back, the rest after the last B (where 1F1B's stage `rank` would wait for the earlier stages).

    B, the gradient of the stage's input, is what the previous stage waits for; W, the weights', only the
    optimizer needs (`backward_input`, `backward_weight`). A stage idles (P-1)(F+B-W) against 1F1B's
    (P-1)(F+B+W) (the paper's section 2) at 1F1B's peak activation memory: rank r holds at most P-r
    unfinished micro-batches plus r awaiting W."""
    warmup = min(n_stages - rank - 1, n_micro)
    actions, deferred = [("forward", 0, m) for m in range(warmup)], []

    def input_backward(m):
        actions.append(("backward", 0, m))
        deferred.append(("weight", 0, m))
        if len(deferred) > rank:
            actions.append(deferred.pop(0))

    for m in range(n_micro - warmup):
        actions.append(("forward", 0, warmup + m))
        input_backward(m)
    for m in range(n_micro - warmup, n_micro):
        input_backward(m)
    return actions + deferred


def zero_bubble_v(n_micro, n_stages, rank):
    """ZB-V: two chunks a rank placed as a V (`v_placement`), chunk 0 on the way down the ranks, chunk 1 on the
    way back up, with every backward split in B and W as in ZB-H1.

    A warm-up fills the V: 2(P-r)-1 forwards of chunk 0, then r pairs of forwards (chunk 1, then chunk 0),
    then P-r rounds of chunk 1's F, B and W. In the steady state each round runs F, B and W of chunk 0,
    then of chunk 1. The cool-down runs what B is left (r pairs with their W deferred, then P-r B's of
    chunk 0 each followed by a deferred W), then the W's still held. It is written for at least 2P-1
    micro-batches (what rank 0's warm-up fills); with fewer, the missing ones' actions are left out.
    """
    if n_stages < 2:
        raise ValueError("ZB-V needs at least two pipeline stages")
    down, up, filled = 0, 1, max(n_micro, 2 * n_stages - 1)
    count, actions = defaultdict(int), []  # count[kind, chunk]: that kind's next micro-batch on that chunk

    def run(*steps):
        for kind, chunk in steps:
            actions.append((kind, chunk, count[kind, chunk]))
            count[kind, chunk] += 1

    F, B, W = "forward", "backward", "weight"
    run(*[(F, down)] * (2 * (n_stages - rank) - 1))                   # warm-up: down the V,
    run(*[(F, up), (F, down)] * rank)                                 # both ways,
    run(*[(F, up), (B, up), (W, up)] * (n_stages - rank))            # the first backwards up the V
    while count[F, down] < filled or count[F, up] < count[F, down]:  # steady state
        run(*[(F, down)] * (count[F, down] < filled), (B, down), (W, down), (F, up), (B, up), (W, up))
    run(*[(B, down), (B, up)] * rank)                                 # cool-down: the last B's,
    run(*[(B, down), (W, down)] * (n_stages - rank))
    run(*[(W, up)] * (count[B, up] - count[W, up]))                   # the W's held back
    run(*[(W, down)] * (count[B, down] - count[W, down]))
    return [action for action in actions if action[2] < n_micro]


def zero_bubble_h1_formula(n_stages, n_micro):
    """ZB-H1's idle fraction (P-1) / (3M + P-1): its idle (P-1)(F+B-W) (Qi et al.) over 3M units of work
    when F, B and W take one each."""
    return (n_stages - 1) / (3 * n_micro + n_stages - 1)


def zero_bubble_v_formula(n_stages, n_micro):
    """ZB-V's: a rank's work is F, B and W of two chunks of half a stage each, 6M units of one chunk's pass;
    with at least 2P-1 micro-batches the V's warm-up is full and a rank idles P-1 units, (P-1) / (6M + P-1),
    a sixth of 1F1B's idle time (P-1)(F+B) in those units, 6(P-1); with fewer micro-batches the gaps are
    those of its timeline, counted there."""
    schedules = [zero_bubble_v(n_micro, n_stages, rank) for rank in range(n_stages)]
    return 1 - 6 * n_micro / len(timeline(schedules, Placement(n_stages, 2, v_placement)))


# the schedules whose bubble_formula is their own
ZERO_BUBBLES = {"zb1": zero_bubble_h1_formula, "zbv": zero_bubble_v_formula}


class Paired(tuple):
    """A forward and a backward of two different micro-batches run as one action (combined 1F1B): each half in
    its own thread, one at a time, handing over where it starts a message it does not need yet (`pass_turn`).
    It needs both halves' messages before it runs and sends both halves' when it is done."""

    def __new__(cls, forward, backward):
        return super().__new__(cls, (forward, backward))

    @property
    def halves(self):
        return tuple(self)

    def run(self, stage, incoming):
        """Both halves on a `_Stage`, taking turns (`_Turns`): the backward first (the next stage's gradient in
        hand, its exchanges start first, Megatron's order); returns what each half sends, forward first."""
        (forward, backward), (activation, gradient) = self, incoming
        backward_output, forward_output = _Turns.run(lambda: stage.backward(*backward[1:], gradient),
                                                     lambda: stage.forward(*forward[1:], activation))
        return [forward_output, backward_output]


def combined_1f1b(n_micro, n_stages, rank):
    """Combined 1F1B (Megatron-LM's, for mixtures of experts): 1F1B with each steady-state forward `Paired` with
    a backward, the two taking turns wherever one has started a message it will wait for later (ep.py's
    all-to-alls call `pass_turn`), so one micro-batch's tokens travel while the other's compute.

    A pair needs its forward's activation and its backward's gradient before it starts, and a neighbour's
    pair of the same turn must not need this one's: stage r pairs the forward of micro-batch k + w_r with
    the backward of k, w_r = 2(P - r) - 1 (1F1B's warm-up is P - r - 1). The stage after needs two forwards
    less, so each pair's gradient comes from a pair that needed a forward two pairs back: one pair of slack,
    as 1F1B has one action. The price: a stage holds up to 2(P - r) micro-batches' activations, 1F1B's
    P - r twice over, the second micro-batch in flight that tools/plan counts. The bubble is 1F1B's."""
    warmup = min(2 * (n_stages - rank) - 1, n_micro)
    actions = [("forward", 0, m) for m in range(warmup)]                                     # warm-up
    actions += [Paired(("forward", 0, warmup + m), ("backward", 0, m)) for m in range(n_micro - warmup)]
    actions += [("backward", 0, m) for m in range(n_micro - warmup, n_micro)]                 # cool-down
    return actions


def forward_only(n_micro, n_stages, rank, n_chunks=1):
    """Every forward and no backward (evaluation), in the order the schedules run forwards."""
    return [("forward", *virtual_step(k, n_stages, n_chunks)) for k in range(n_micro * n_chunks)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb1": zero_bubble_h1,
             "zbv": zero_bubble_v, "combined": combined_1f1b}
CHUNKS_A_RANK = {"interleaved": 2, "zbv": 2}  # the schedules that run several chunks a rank, and how many by default
SPLIT_BACKWARD = ("zb1", "zbv")                # the schedules whose backward is B, then W later
ONE_STAGE_TOO = ("combined",)                  # the schedules worth running without a pipeline: pairs overlap there


class Schedule(list):
    """A rank's actions, and the `Placement` its schedule was written for, which `run_schedule` runs on
    unless told otherwise: a V schedule knows it is V-shaped."""

    def __init__(self, actions, placement):
        super().__init__(actions)
        self.placement = placement


def make_schedule(name, n_micro, n_stages, rank, n_chunks=None):
    """Rank `rank`'s actions under the schedule `name`, as a `Schedule` carrying its placement; n_chunks a
    rank (default: the schedule's own, `CHUNKS_A_RANK`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    n_chunks = n_chunks or CHUNKS_A_RANK.get(name, 1)
    if name == "zbv" and n_chunks != 2:
        raise ValueError(f"ZB-V places exactly two chunks on each rank, not {n_chunks}")
    if name != "zbv" and (name == "interleaved") != (n_chunks > 1):
        raise ValueError("the interleaved schedule needs more than one virtual stage, and only it can use them")
    if name == "interleaved":
        actions = interleaved_1f1b(n_micro, n_stages, rank, n_chunks)
    else:
        actions = SCHEDULES[name](n_micro, n_stages, rank)
    return Schedule(actions, Placement.of(name, n_stages, n_chunks))


# ---------------------------------------------------------------------------
# A backward in two halves (ZB-H1, ZB-V): B, the input's gradient now; W, the weights' later
# ---------------------------------------------------------------------------

class _SplitBackward(_Stage):
    """ZB-H1's and ZB-V's backward in two actions: the backward runs B (`backward_input`), the input's gradient only, and
    keeps in `saved` what is left; the weight action later runs W (`backward_weight`), which sums the weights'."""

    summing = "weight"

    def backward(self, c, m, grad):
        """B; returns the gradient of the chunk's input."""
        x, roots, grads = self._backward_start(c, m, grad)
        with self.reduction.grad_sync.no_sync():  # no weight's gradient is summed here
            x_grad, self.saved[c, m] = backward_input(roots, grads, x)
        return x_grad

    def weight(self, c, m):
        """W."""
        *firsts, last = self.saved.pop((c, m))
        with self.reduction.context(("weight", c, m)):
            with self.reduction.grad_sync.keep_incomplete_buckets():
                backward_weight(firsts)  # a W is several backwards: the end of the last is the end of W
            backward_weight([last])


def backward_graph(roots):
    """The nodes of the backward graph below `roots` (autograd Nodes), in the order a breadth-first walk finds
    them, and each node's parents. The order is the graph's, the same on every rank (a set's would follow
    memory addresses): W's backwards run in it, and the collectives inside them (tp's sums of a norm's
    gradient) must come in the same order on every rank of their group."""
    parents, seen, queue = defaultdict(list), dict.fromkeys(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen[child] = None
                    queue.append(child)
    return list(seen), parents


def above(node, parents, stop=lambda node: False):
    """The nodes above `node` (those whose gradient flows into it), climbing no further than where `stop`
    holds; returns (every node climbed, those where it stopped or that have no parent)."""
    climbed, ends, queue = {node}, set(), deque([node])
    while queue:
        current = queue.popleft()
        if current is not node and stop(current) or not parents[current]:
            ends.add(current)
            continue
        for parent in parents[current]:
            if parent not in climbed:
                climbed.add(parent)
                queue.append(parent)
    return climbed, ends


def backward_input(roots, grads, x):
    """B: the gradient of the stage input x from (roots, grads), keeping what W needs.

    Autograd computes only what leads to the tensors asked for: a backward to x alone runs the nodes on
    x's path (the input path) and none of the branches that lead off it to weights only. Each weight's
    branch leaves the input path at the first input-path nodes above the weight; a hook there records
    the gradient flowing through. W later runs each branch from those nodes with those gradients. Returns
    (x's gradient, the work W has to do); on the first stage (token ids, no gradient) W does it all.
    """
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]  # a loss's gradient is 1
    nodes, parents = backward_graph([r.grad_fn for r in roots])
    accumulators = [n for n in nodes if hasattr(n, "variable")]  # a leaf's node: where its .grad is summed
    x_node = next((n for n in accumulators if n.variable is x), None)
    if x_node is None:
        return None, [(roots, grads, [n.variable for n in accumulators])]
    input_path, _ = above(x_node, parents)
    branches = defaultdict(list)  # the nodes a weight's branch leaves the input path at -> those weights
    for node in accumulators:
        if node is not x_node:
            _, leaves_at = above(node, parents, stop=lambda n: n in input_path)
            branches[frozenset(leaves_at)].append(node.variable)
    recorded = {(r.grad_fn, r.output_nr): g for r, g in zip(roots, grads)}  # roots off the input path

    def record(node, grad_outputs):
        recorded.update({(node, i): g for i, g in enumerate(grad_outputs) if g is not None})

    hooks = [node.register_prehook(partial(record, node)) for node in set().union(*branches) if node in input_path]
    try:
        torch.autograd.backward(roots, grads, inputs=[x], retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    work = []
    for leaves_at, weights in branches.items():
        edges = [(GradientEdge(node, i), g) for (node, i), g in recorded.items() if node in leaves_at]
        work.append(([e for e, _ in edges], [g for _, g in edges], weights))
    return x.grad, work


def backward_weight(work):
    """W: each weight's branch, from where it leaves the input path, with the gradient B recorded there.
    One backward per group of weights that leave at the same nodes, so no branch is run twice."""
    for outputs, grads, weights in work:
        torch.autograd.backward(outputs, grads, inputs=weights, retain_graph=True)


# ---------------------------------------------------------------------------
# Combined 1F1B's pairs: two halves taking turns around the messages they start
# ---------------------------------------------------------------------------

class _Turns:
    """Two threads taking turns: one runs at a time, and hands over only at `pass_turn` or when it ends. Where
    they hand over is fixed by the code they run, so on every rank the two interleave alike, and every
    collective of either is issued in the same order on every rank of its group (NCCL matches by order)."""

    running = None  # the pair of threads taking turns now, if any

    def __init__(self):
        self.condition, self.turn, self.ended = threading.Condition(), 0, [False, False]

    def pass_turn(self):
        with self.condition:
            mine = self.turn
            if self.ended[1 - mine]:  # the other has ended: go on
                return
            self.turn = 1 - mine
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == mine)

    def take_part(self, side, work, results):
        """Run `work` as `side` (0 starts), once it is its turn; its result, or what it raised, in results[side]."""
        with self.condition:
            self.condition.wait_for(lambda: self.turn == side)
        try:
            results[side] = (work(), None)
        except BaseException as error:  # (re-raised by the caller: the other side goes on alone meanwhile)
            results[side] = (None, error)
        with self.condition:
            self.ended[side], self.turn = True, 1 - side
            self.condition.notify_all()

    @classmethod
    def run(cls, first, second):
        """first() here and second() in a thread of its own (on this thread's CUDA device and stream), taking
        turns, first() starting; returns both results."""
        turns, results, device = cls(), [None, None], _DeviceContext()
        cls.running = turns
        try:
            thread = threading.Thread(target=turns.take_part, args=(1, device.wrap(second), results),
                                      name="pp paired half")
            thread.start()
            turns.take_part(0, first, results)
            thread.join()
        finally:
            cls.running = None
        for _, error in results:
            if error is not None:
                raise error
        return [result for result, _ in results]


class _DeviceContext:
    """The calling thread's CUDA device and stream, which a new thread does not inherit (it starts on device 0
    and the default stream)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.stream = torch.cuda.current_stream() if self.cuda else None

    def wrap(self, work):
        if not self.cuda:
            return work

        def on_device():
            torch.cuda.set_device(self.stream.device)
            with torch.cuda.stream(self.stream):
                return work()
        return on_device


def pass_turn():
    """Let the other half of the paired action running now compute, and go on once it hands back (or ends):
    called right after starting a message that will be waited for later (train.py hands it to ep.py's
    all-to-alls). Outside a paired action, nothing."""
    if _Turns.running is not None:
        _Turns.running.pass_turn()


def per_thread(obj, *names):
    """obj's attributes `names` held apart for each thread, in place: each thread of a pair reads what its own
    half last wrote (what a forward leaves on a layer for its caller to read, say its auxiliary loss, or that
    it is being recomputed for backward), not what the other half wrote while it waited for its turn. A thread
    that has not written one reads the value the attribute had here."""
    held = {name: obj.__dict__.pop(name) for name in names}
    obj.__class__ = type(type(obj).__name__, (type(obj),), {name: _PerThread(held[name]) for name in names})
    return obj


class _PerThread:
    """A data descriptor whose value is the calling thread's (threading.local); `default` for any other."""

    def __init__(self, default):
        self.default, self.values = default, threading.local()

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(self.values, "value", self.default)

    def __set__(self, obj, value):
        self.values.value = value


# ---------------------------------------------------------------------------
# Placement: which rank holds model chunk k (the one rule every message follows)
# ---------------------------------------------------------------------------

def interleaved_placement(k, n_stages):
    """(rank, its chunk index) of model chunk k in a loop over the ranks: rank r holds chunks r, r+P, r+2P, ...
    (Megatron-LM's interleaving; with one chunk a rank, the plain split)."""
    return k % n_stages, k // n_stages


def v_placement(k, n_stages):
    """(rank, its chunk index) of model chunk k in a V: down the ranks, then back up, so that rank r holds
    chunks r and 2P-1-r, and rank 0 both the first and the last (ZB-V's placement)."""
    return (k, 0) if k < n_stages else (2 * n_stages - 1 - k, 1)


PLACEMENTS = {"zbv": v_placement}  # every other schedule places its chunks in a loop


class Placement:
    """Where P ranks x V chunks of a model are: `rule(k, P)` gives the rank holding model chunk k and that
    chunk's index on the rank (an action's chunk). Two placements are equal if they put the same model
    chunks on the same ranks in the same order."""

    def __init__(self, n_stages, n_chunks=1, rule=interleaved_placement):
        self.n_stages, self.n_chunks, self.rule = n_stages, n_chunks, rule
        self.n_model_chunks = n_stages * n_chunks
        held = {self.holder(k): k for k in range(self.n_model_chunks)}  # the rule inverted, once
        self._held = [[held[rank, c] for c in range(n_chunks)] for rank in range(n_stages)]

    @classmethod
    def of(cls, schedule, n_stages, n_chunks=1):
        """The placement a schedule (by name) runs on."""
        return cls(n_stages, n_chunks, PLACEMENTS.get(schedule, interleaved_placement))

    def holder(self, k):
        """(rank, chunk index) of model chunk k."""
        return self.rule(k, self.n_stages)

    def model_chunks(self, rank):
        """The model chunks `rank` holds, by chunk index."""
        return self._held[rank]

    @property
    def first_rank(self):
        """The rank holding the first model chunk (the embedding)."""
        return self.holder(0)[0]

    @property
    def last_rank(self):
        """The rank holding the last model chunk (the output layer and the loss)."""
        return self.holder(self.n_model_chunks - 1)[0]

    def ends_apart(self):
        """Whether the first and the last model chunk are on two ranks (so a weight both use, a tied embedding
        and output layer, has a copy on each)."""
        return self.first_rank != self.last_rank

    def __eq__(self, other):
        return isinstance(other, Placement) and self._held == other._held

    def __hash__(self):
        return hash(tuple(map(tuple, self._held)))

    def __repr__(self):
        """The expression that makes it (what to pass as run_schedule's `placement=`)."""
        name = next((name for name, rule in PLACEMENTS.items() if rule is self.rule), None)
        if name:
            return f"Placement.of({name!r}, {self.n_stages}, {self.n_chunks})"
        rule = "" if self.rule is interleaved_placement else f", {self.rule.__name__}"
        return f"Placement({self.n_stages}, {self.n_chunks}{rule})"

    @classmethod
    def to_run(cls, actions, placement, n_stages, n_chunks):
        """The placement `run_schedule` runs this rank's `actions` on, given its `placement` argument and this
        rank's n_chunks: that argument, else the one the actions were written for (a `Schedule`'s), else a loop.
        A placement that differs from the schedule's is refused before anything runs: the schedule's order
        would deadlock there, or run in an order it was not written for."""
        written_for = getattr(actions, "placement", None)
        placement = placement or written_for or cls(n_stages, n_chunks)
        if written_for is not None and placement != written_for:
            raise ValueError(f"the schedule was written for placement={written_for!r}, not {placement!r}: "
                             f"pass that one (or none)")
        if placement.n_chunks != n_chunks:
            raise ValueError(f"the placement puts {placement.n_chunks} chunks on each rank; this rank has {n_chunks}")
        return placement

    def deadlock(self, schedules, t):
        """The error for schedules that no rank can go on with at step t here: if they run on another
        placement a schedule is written for (ZB-V's V), the placement is what is wrong, and it says which."""
        stuck = f"no rank can run its next action at step {t} on {self!r}"
        for name in PLACEMENTS:
            try:
                other = Placement.of(name, self.n_stages, self.n_chunks)
                if other != self and timeline(schedules, other):
                    return ValueError(f"{stuck}, but these schedules run on {other!r}: pass run_schedule "
                                      f"placement={other!r} and list each rank's chunks in its order, rank r's "
                                      f"model_chunks(r): {[other.model_chunks(r) for r in range(other.n_stages)]}")
            except (KeyError, ValueError):  # the rule places no such number of chunks, or they deadlock there too
                continue
        return ValueError(f"the schedule deadlocks: {stuck}")


# ---------------------------------------------------------------------------
# Measuring: the device's time, the bubble, the activations in flight
# ---------------------------------------------------------------------------

class Stopwatch:
    """Adds up intervals of the device's time.

    CUDA runs kernels asynchronously: a host clock around them measures only their launch. There the
    ends of each interval are CUDA events recorded on the current stream, read (after a synchronize)
    only when the total is asked for, so timing never stalls the pipeline; on a CPU the host clock is
    the device's clock.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.intervals = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start, end):
        self.intervals.append((start, end))

    def elapsed(self, start, end):
        """Seconds from one mark of now() to another (on CUDA, once the events have happened)."""
        if not self.cuda:
            return end - start
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000

    def seconds(self):
        return sum(self.elapsed(start, end) for start, end in self.intervals)


class PipelineStats:
    """What one rank measured while running schedules: for the bubble and the memory claims."""

    def __init__(self, device="cpu", record=False):
        self.compute, self.wait, self.total = Stopwatch(device), Stopwatch(device), Stopwatch(device)
        self.peak_in_flight = 0   # micro-batches whose activations were alive at once, at most
        self.bytes_sent = 0
        self.actions = [] if record else None  # with record: every action's times, for `timeline`
        self.origin = None

    def record(self, action, wait, start, end):
        """One action's marks: it waited for its input message from `wait`, then computed from `start` to `end`
        (a paired action's halves both, over the same span)."""
        self.wait.add(wait, start)
        self.compute.add(start, end)
        if self.actions is not None:
            self.actions += [(half, wait, start, end) for half in halves(action)]

    def timeline(self):
        """[(kind, chunk, micro-batch, waiting from, computing from, until)] in seconds since the schedule
        started (after a barrier of the stages, so every rank's times are on one axis)."""
        since = lambda mark: self.total.elapsed(self.origin, mark)  # noqa: E731
        return [(*action, since(wait), since(start), since(end)) for action, wait, start, end in self.actions]

    @property
    def wait_s(self):
        return self.wait.seconds()

    def bubble(self):
        """Measured idle fraction: the time this rank was not computing."""
        total = self.total.seconds()
        return 1.0 - self.compute.seconds() / total if total else 0.0


# ---------------------------------------------------------------------------
# The data-parallel reduction: when each chunk's gradients are complete
# ---------------------------------------------------------------------------

class _NoGradSync:
    """Stands in for grad_sync=None (no data parallelism): there is nothing to reduce, so its contexts do nothing."""

    def no_sync(self):
        return nullcontext()

    def keep_incomplete_buckets(self):
        return nullcontext()


class _ReductionPlan:
    """Under which context of grad_sync each of this rank's gradient sums runs: the data-parallel reduction plan.

    The weights' gradients are summed by the actions of kind `summing` (the backward, or ZB-H1's weight pass).
    A chunk's gradients are complete after its last such action, so the reduction runs during that one, once
    per step; but a rank holds several chunks (interleaving), and only its final action may launch what is
    still incomplete, or it would launch buckets of chunks whose gradients have yet to come:

        not the chunk's last                      grad_sync.no_sync()                   accumulate only
        the chunk's last, not the rank's final    grad_sync.keep_incomplete_buckets()   launch the full buckets
        the rank's final                          (none)                                launch everything left

    Chunks that share a weight count as one: a tied embedding and output layer, which a V puts on rank 0 in
    its first and last chunk, is complete only after the later of the two chunks' last sums.
    """

    def __init__(self, actions, summing, grad_sync, chunks):
        sums = [action for action in every_half(actions) if action[0] == summing]
        self.unit = _weight_sharing(chunks)
        self.unit_last = {}
        for action in sums:  # in order: what is left is each unit's last
            self.unit_last[self.unit[action[1]]] = action
        self.final = sums[-1] if sums else None
        self.grad_sync = grad_sync or _NoGradSync()

    def context(self, action):
        """The context around the gradient sums of `action` (one of kind `summing`)."""
        if action == self.final:
            return nullcontext()
        if action == self.unit_last[self.unit[action[1]]]:
            return self.grad_sync.keep_incomplete_buckets()
        return self.grad_sync.no_sync()


def _weight_sharing(chunks):
    """{chunk index: the first of this rank's chunks it shares a weight with, else itself}; a chunk without
    parameters() (any callable) shares nothing."""
    first_user, unit = {}, {}
    for c, chunk in enumerate(chunks):
        weights = chunk.parameters() if hasattr(chunk, "parameters") else []
        unit[c] = min([first_user.setdefault(w, c) for w in weights], default=c)
    return unit


# ---------------------------------------------------------------------------
# Applying it to model.py's GPT (the only model knowledge in this file)
# ---------------------------------------------------------------------------

class GPTChunk:
    """Layers [layers] of a GPT; the first chunk embeds token ids, the last returns logits."""

    def __init__(self, model, layers, first, last, positions=None):
        self.model, self.layers, self.first, self.last = model, layers, first, last
        # The positions of the tokens this rank holds (None: 0..seq_len-1), which every block needs
        # (rotary embeddings); a later stage only sees hidden states, which may be a shard of them.
        self.positions = torch.arange(model.config.seq_len) if positions is None else positions

    def __call__(self, x, documents=None):
        """x: token ids (the first chunk) or the previous chunk's output; documents: the micro-batch's
        packed documents (model.py's document_ids, of the whole sequence), or None."""
        m = self.model
        pos = m.token_positions(self.positions.to(x.device), documents)
        if self.first:
            x = m.embed(x, pos)
        for i in self.layers:
            x = m.blocks[i](x, pos, documents)
        y = m.lm_head(m.norm(x)) if self.last else x
        # The load-balancing losses of this chunk's MoE layers (set by their forward) are its side loss.
        aux = [mod.aux_loss for i in self.layers for mod in m.blocks[i].modules()
               if isinstance(getattr(mod, "aux_loss", None), torch.Tensor)]
        return (y, m.config.aux_loss_coef * sum(aux)) if aux else y

    def modules(self):
        """The model's modules this chunk runs."""
        m = self.model
        modules = [*([m.tok_emb, m.pos_emb] if self.first else []), *(m.blocks[i] for i in self.layers),
                   *([m.norm, m.lm_head] if self.last else [])]
        return [module for module in modules if module is not None]

    def parameters(self):
        """The weights this chunk uses (a tied weight in both the first and the last chunk)."""
        return [p for module in self.modules() for p in module.parameters()]


def apply_pipeline_parallel(model, group, placement=None, positions=None):
    """Keep only this rank's layers of a GPT (others become empty); returns its chunks in order.

    placement: where the model chunks are (a Placement; default: one a rank).
    Parameter names stay those of the full model, so checkpoints merge across stages by name.
    positions: those of the tokens this rank holds, if not 0..seq-1 (context parallelism).
    """
    n_stages, rank = dist.get_world_size(group), dist.get_rank(group)
    placement = placement or Placement(n_stages)
    last = placement.n_model_chunks - 1
    ranges = split_layers(model.config.n_layer, placement.n_model_chunks)
    mine = placement.model_chunks(rank)
    kept = {i for chunk in mine for i in ranges[chunk]}
    for i in range(model.config.n_layer):
        if i not in kept:
            model.blocks[i] = nn.Identity()
    if 0 not in mine:
        model.tok_emb = model.pos_emb = None
    if last not in mine:
        model.norm = model.lm_head = None
    return [GPTChunk(model, ranges[chunk], chunk == 0, chunk == last, positions) for chunk in mine]


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node 4 pp.py
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
    device = _join_process_group()
    backend, rank, n_stages = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    width, n_layers = 8, 2 * n_stages
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()).to(device, torch.float64) for _ in range(n_layers)]
    n_micro, batch = 2 * n_stages, 3
    data = torch.randn(n_micro, batch, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    micro_batches = [(x.to(device), x.flip(-1).to(device)) for x in data]
    loss_fn = lambda y, target: (y - target).square().mean()  # noqa: E731

    # Single device: every layer, gradient accumulation over the micro-batches.
    ref_loss = 0.0
    for x, target in micro_batches:
        for layer in layers:
            x = layer(x)
        loss = loss_fn(x, target)
        (loss / n_micro).backward()
        ref_loss += loss.item() / n_micro
    ref_grads = [p.grad.clone() for layer in layers for p in layer.parameters()]

    checked = [("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("combined", 1), ("interleaved", 2), ("zbv", 2)]
    for name, n_chunks in checked if n_stages > 1 else checked[:4]:
        for p in (p for layer in layers for p in layer.parameters()):
            p.grad = None
        schedules = [make_schedule(name, n_micro, n_stages, r, n_chunks) for r in range(n_stages)]
        ranges = split_layers(n_layers, n_stages * n_chunks)
        mine = schedules[rank].placement.model_chunks(rank)  # the copy contract: chunks in the placement's order
        chunks = [nn.Sequential(*[layers[i] for i in ranges[k]]) for k in mine]
        stats = PipelineStats()
        losses, _ = run_schedule(schedules, chunks, micro_batches, loss_fn, None, (batch, width), torch.float64,
                                 device, stats=stats)
        worst = 0.0
        for k in mine:
            for i in ranges[k]:
                for p, ref in zip(layers[i].parameters(), ref_grads[2 * i:2 * i + 2]):
                    worst = max(worst, (p.grad - ref).abs().max().item())
        if losses:
            worst = max(worst, abs(sum(losses) / n_micro - ref_loss))
        worst_all = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"pp.py self-check, {name:11s} on {n_stages} stages x {n_chunks} chunks, {n_micro} micro-batches "
                  f"({backend}): largest difference from one device (loss, gradients, float64) = "
                  f"{worst_all.item():.3g}; stage 0 held {stats.peak_in_flight} chunks' activations at once",
                  flush=True)
        if worst_all.item() > 1e-12:
            raise SystemExit(f"rank {rank}: the {name} pipeline differs from the single device")
    dist.destroy_process_group()


if __name__ == "__main__":
    _self_check()
