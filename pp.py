"""Pipeline parallelism: layers split into stages, micro-batches scheduled through them.

The article's assembly line. P ranks each hold a contiguous slice of the
layers; rank 0 also the embedding, rank P-1 the final norm, the head and the
loss. A micro-batch's activations flow forward stage to stage, its gradients
flow back. With one micro-batch only one stage works at a time; with M
micro-batches the idle fraction per stage (the bubble) is

    bubble = (P - 1) / (M + P - 1)          (article: 3/4 for P=4, M=1; 1/5 for M=12)

Three schedules, each a flat function that lists what this rank does, in
order, as ("forward" | "backward", chunk, micro_batch) actions:

- GPipe: every forward, then every backward. M micro-batches' activations
  are alive at once.
- 1F1B: a warm-up of P-1-rank forwards, then one forward and one backward in
  turn, then the remaining backwards. At most P micro-batches are alive.
- Interleaved 1F1B (Megatron-LM): each rank holds V non-adjacent chunks
  (rank r: chunks r, r+P, r+2P, ...), so a micro-batch visits every rank V
  times; the bubble shrinks by V for V times the point-to-point messages.

`run_schedule` executes any such list: before a forward (backward) it
receives the input (output gradient) it needs from the previous (next)
rank; after it, it sends what the neighbour needs. Sends never block: each
is posted with `batch_isend_irecv` as soon as its tensor exists and waited
for only at the end, so a rank has issued every send before it waits for
anything, and no ordering of valid actions can deadlock. Receives are
posted one action ahead, so the next message can land while this rank
computes rather than wait in the sender's socket until it is asked for.
Activations and gradients use different tags, and every message has a
shape both sides know: (micro_batch, seq, hidden).

Self-check: torchrun --nproc_per_node 4 pp.py
"""
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

FORWARD_TAG, BACKWARD_TAG = 0, 1  # activations travel with one tag, gradients with the other


def bubble_formula(n_stages, n_micro, n_chunks=1):
    """The ideal idle fraction (P-1) / (V*M + P-1) of a stage (V = 1 without interleaving)."""
    return (n_stages - 1) / (n_chunks * n_micro + n_stages - 1)


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


# ---------------------------------------------------------------------------
# Schedules: what this rank does, in order
# ---------------------------------------------------------------------------

def gpipe(n_micro, n_stages, rank):
    """All forwards, then all backwards (GPipe, "all forward all backward")."""
    return ([("forward", 0, m) for m in range(n_micro)] +
            [("backward", 0, m) for m in range(n_micro)])


def one_f_one_b(n_micro, n_stages, rank):
    """1F1B: warm-up forwards, then alternate one forward and one backward, then cool-down backwards."""
    warmup = min(n_stages - rank - 1, n_micro)
    actions = [("forward", 0, m) for m in range(warmup)]                     # warm-up
    for m in range(n_micro - warmup):                                         # steady state
        actions += [("forward", 0, warmup + m), ("backward", 0, m)]
    actions += [("backward", 0, m) for m in range(n_micro - warmup, n_micro)]  # cool-down
    return actions


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
    """Megatron-LM's interleaved 1F1B over n_chunks virtual stages per rank."""
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


def forward_only(n_micro, n_stages, rank, n_chunks=1):
    """Every forward and no backward (evaluation), in the order the schedules run forwards."""
    return [("forward", *virtual_step(k, n_stages, n_chunks)) for k in range(n_micro * n_chunks)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def make_schedule(name, n_micro, n_stages, rank, n_chunks=1):
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    if (name == "interleaved") != (n_chunks > 1):
        raise ValueError("the interleaved schedule needs more than one virtual stage, and only it can use them")
    if name == "interleaved":
        return interleaved_1f1b(n_micro, n_stages, rank, n_chunks)
    return SCHEDULES[name](n_micro, n_stages, rank)


# ---------------------------------------------------------------------------
# Running a schedule
# ---------------------------------------------------------------------------

class PipelineStats:
    """What one rank measured while running schedules: for the bubble and the memory claims."""

    def __init__(self):
        self.compute_s = self.wait_s = self.total_s = 0.0
        self.peak_in_flight = 0   # micro-batches whose activations were alive at once, at most
        self.bytes_sent = 0

    def bubble(self):
        """Measured idle fraction: the time this rank was not computing."""
        return 1.0 - self.compute_s / self.total_s if self.total_s else 0.0


class _P2P:
    """Point-to-point with one neighbour on each side; a send is posted at once and never waited for."""

    def __init__(self, group, shape, dtype, device, debug):
        self.group, self.shape, self.dtype, self.device, self.debug = group, shape, dtype, device, debug
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.prev = dist.get_global_rank(group or dist.group.WORLD, (rank - 1) % n)
        self.next = dist.get_global_rank(group or dist.group.WORLD, (rank + 1) % n)
        self.in_flight = []
        self.bytes_sent = 0

    def send(self, tensor, peer, tag, what):
        tensor = tensor.detach().to(self.dtype).contiguous()
        self._log(f"send {what} to rank {peer}")
        # Posted now, so the neighbour can start as soon as it likes; completes on its own (waited at the end).
        self.in_flight += dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, self.group, tag)])
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def post_recv(self, peer, tag, what):
        """Post a receive now; returns a function that waits for it and gives the tensor."""
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._log(f"post recv {what} from rank {peer}")
        work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, peer, self.group, tag)])[0]

        def wait():
            work.wait()
            return buffer
        return wait

    def flush(self):
        for work in self.in_flight:
            work.wait()
        self.in_flight = []

    def _log(self, message):
        if self.debug:
            print(f"[pp rank {dist.get_rank(self.group)}] {message}", flush=True)


def run_schedule(actions, chunks, micro_batches, loss_fn, group, shape, dtype, device,
                 grad_sync=None, stats=None, debug=False, forward_context=nullcontext):
    """Execute this rank's actions; returns (losses, side_losses) as floats.

    losses: of each micro-batch, on the last stage (elsewhere []). side_losses:
    of each (chunk, micro-batch) whose chunk returned one (an MoE layer's
    load-balancing loss), on any stage: its gradient flows from where it is
    computed, so no stage has to hold every stage's side losses.
    chunks: this rank's model chunks, callables x -> y or (y, side_loss) (chunk c is model chunk c*P + rank).
    micro_batches: (inputs, targets) per micro-batch; the first stage reads inputs, the last targets.
    loss_fn(output, targets): the loss of one micro-batch; gradients average over micro-batches.
    grad_sync: a data-parallel wrapper with no_sync(): gradients are reduced only during the last
    backward of each chunk, once per step. Without backward actions this is an inference pass.
    forward_context: entered around every forward (autocast, activation counting).
    """
    n_stages, rank = dist.get_world_size(group), dist.get_rank(group)
    p2p = _P2P(group, shape, dtype, device, debug or os.environ.get("PP_DEBUG") == "1")
    stats = stats or PipelineStats()
    last_backward = {chunk: max(m for kind, c, m in actions if kind == "backward" and c == chunk)
                     for chunk in {c for kind, c, _ in actions if kind == "backward"}}
    n_model_chunks = len(chunks) * n_stages

    def about(kind, c, m):
        """An action's model chunk, whether it is the first or the last, and what it passes on."""
        model_chunk = c * n_stages + rank
        what = f"{'activation' if kind == 'forward' else 'gradient'} (micro-batch {m}, chunk {model_chunk})"
        return model_chunk == 0, model_chunk == n_model_chunks - 1, what

    def post_receive(i):
        """Post the receive action i needs, if any (the first chunk's forward reads tokens, the last's
        backward starts from the loss); returns the function that waits for it."""
        if i == len(actions):
            return None
        kind = actions[i][0]
        first, last, what = about(*actions[i])
        if kind == "forward" and not first:
            return p2p.post_recv(p2p.prev, FORWARD_TAG, what)
        if kind == "backward" and not last:
            return p2p.post_recv(p2p.next, BACKWARD_TAG, what)
        return None

    saved, losses, side_losses, in_flight = {}, [], [], 0
    start = time.perf_counter()
    next_receive = post_receive(0)
    for i, (kind, c, m) in enumerate(actions):
        receive, next_receive = next_receive, post_receive(i + 1)  # one action ahead
        first, last, what = about(kind, c, m)
        if kind == "forward":
            wait = time.perf_counter()
            x = micro_batches[m][0] if first else receive().requires_grad_()
            compute = time.perf_counter()
            stats.wait_s += compute - wait
            with forward_context():
                y = chunks[c](x)
                y, side = y if isinstance(y, tuple) else (y, None)
                # What backward starts from: this micro-batch's share of the loss (the mean over micro-batches,
                # as gradient accumulation does) on the last stage, the output elsewhere, plus any side loss.
                roots = []
                if side is not None:
                    side_losses.append(side.detach())
                    roots.append(side / len(micro_batches))
                if last:
                    loss = loss_fn(y, micro_batches[m][1])
                    losses.append(loss.detach())
                    roots.append(loss / len(micro_batches))
            stats.compute_s += time.perf_counter() - compute
            if not last:
                p2p.send(y, p2p.next, FORWARD_TAG, what)
            if torch.is_grad_enabled():
                saved[c, m] = (x, y if not last else None, roots)
                in_flight += 1
                stats.peak_in_flight = max(stats.peak_in_flight, in_flight)
        else:
            x, y, roots = saved.pop((c, m))
            wait = time.perf_counter()
            if not last:
                roots = [y, *roots]
                grads = [receive()] + [None] * (len(roots) - 1)
            else:
                grads = [None] * len(roots)
            compute = time.perf_counter()
            stats.wait_s += compute - wait
            reduce_now = grad_sync is None or m == last_backward[c]
            with nullcontext() if reduce_now else grad_sync.no_sync():
                torch.autograd.backward(roots, grads)
            stats.compute_s += time.perf_counter() - compute
            in_flight -= 1
            if not first:
                p2p.send(x.grad, p2p.prev, BACKWARD_TAG, what)
    p2p.flush()
    stats.total_s += time.perf_counter() - start
    stats.bytes_sent += p2p.bytes_sent
    return [loss.item() for loss in losses], [side.item() for side in side_losses]


# ---------------------------------------------------------------------------
# Applying it to model.py's GPT (the only model knowledge in this file)
# ---------------------------------------------------------------------------

class GPTChunk:
    """Layers [layers] of a GPT; the first chunk embeds token ids, the last returns logits."""

    def __init__(self, model, layers, first, last, positions=None):
        self.model, self.layers, self.first, self.last = model, layers, first, last
        self.positions = positions  # of the tokens this rank holds (None: 0..seq-1)

    def __call__(self, x):
        m = self.model
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device) if self.positions is None else self.positions
            x = m.tok_emb(x) + m.pos_emb(pos)
        for i in self.layers:
            x = m.blocks[i](x)
        y = m.lm_head(m.norm(x)) if self.last else x
        # The load-balancing losses of this chunk's MoE layers (set by their forward) are its side loss.
        aux = [mod.aux_loss for i in self.layers for mod in m.blocks[i].modules()
               if isinstance(getattr(mod, "aux_loss", None), torch.Tensor)]
        return (y, m.config.aux_loss_coef * sum(aux)) if aux else y


def apply_pipeline_parallel(model, group, n_chunks=1, positions=None):
    """Keep only this rank's layers of a GPT (others become empty); returns its chunks in order.

    Parameter names stay those of the full model, so checkpoints merge across stages by name.
    positions: those of the tokens this rank holds, if not 0..seq-1 (context parallelism).
    """
    n_stages, rank = dist.get_world_size(group), dist.get_rank(group)
    ranges = split_layers(model.config.n_layer, n_stages * n_chunks)
    mine = [c * n_stages + rank for c in range(n_chunks)]
    kept = {i for chunk in mine for i in ranges[chunk]}
    for i in range(model.config.n_layer):
        if i not in kept:
            model.blocks[i] = nn.Identity()
    if 0 not in mine:
        model.tok_emb = model.pos_emb = None
    if n_stages * n_chunks - 1 not in mine:
        model.norm = model.lm_head = None
    return [GPTChunk(model, ranges[chunk], chunk == 0, chunk == n_stages * n_chunks - 1, positions)
            for chunk in mine]


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node 4 pp.py
# ---------------------------------------------------------------------------

def _self_check():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, n_stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
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

    for name, n_chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        for p in (p for layer in layers for p in layer.parameters()):
            p.grad = None
        ranges = split_layers(n_layers, n_stages * n_chunks)
        chunks = [nn.Sequential(*[layers[i] for i in ranges[c * n_stages + rank]]) for c in range(n_chunks)]
        stats = PipelineStats()
        actions = make_schedule(name, n_micro, n_stages, rank, n_chunks)
        losses, _ = run_schedule(actions, chunks, micro_batches, loss_fn, None, (batch, width), torch.float64,
                                 device, stats=stats)
        worst = 0.0
        for c in range(n_chunks):
            for i in ranges[c * n_stages + rank]:
                for p, ref in zip(layers[i].parameters(), ref_grads[2 * i:2 * i + 2]):
                    worst = max(worst, (p.grad - ref).abs().max().item())
        if losses:
            worst = max(worst, abs(sum(losses) / n_micro - ref_loss))
        worst_all = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"pp.py self-check, {name:11s} on {n_stages} stages x {n_chunks} chunks, {n_micro} micro-batches "
                  f"({backend}): largest difference from one device (loss, gradients, float64) = "
                  f"{worst_all.item():.3g}; stage 0 held {stats.peak_in_flight} micro-batches' activations at once",
                  flush=True)
        if worst_all.item() > 1e-12:
            raise SystemExit(f"rank {rank}: the {name} pipeline differs from the single device")
    dist.destroy_process_group()


if __name__ == "__main__":
    _self_check()
