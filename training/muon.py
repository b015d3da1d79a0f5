"""Muon for the blocks' matrices, AdamW for the rest, with each matrix assembled whole on one rank however
the layout cuts it (--optimizer muon).

Muon (Jordan et al., 2024) as Moonlight scales it for large models (Liu et al., 2025, "Muon is Scalable for
LLM Training", Algorithm 1), for a matrix W with gradient G:

    M = mu M + G                                  momentum, mu = 0.95
    U = G + mu M                                  Nesterov's look-ahead
    O = NewtonSchulz5(U)                          about the orthogonal polar factor of U (U = P S Q^T -> P Q^T)
    W = W - lr (0.2 sqrt(max(rows, cols)) O + wd W)

The factor 0.2 sqrt(max(rows, cols)) gives the update the RMS of AdamW's (Moonlight's equation 4: an
orthogonal rows x cols matrix has RMS 1/sqrt(max(rows, cols)); AdamW's is about 0.2), so that the learning
rate and the weight decay carry over from AdamW. Newton-Schulz runs five times Jordan's quintic iteration
in the weights' dtype (bfloat16 as his, float64 in the tests).

Which weights: Muon takes each logical matrix of the blocks on its own, as a Hugging Face folder holds them
(q, k and v of the fused qkv; gate and up of a SwiGLU fc; each expert's matrices; the output projections),
since orthogonalising q | k | v together would couple three matrices that play different parts. AdamW, with
the same learning rate and weight decay, takes the embedding, the output layer, norms, biases and the router
(Moonlight's and Jordan's split: an embedding's rows are not a linear map's, and the router is a vector per
expert).

Across ranks: Newton-Schulz is a function of the whole matrix, so the elementwise sharding of ZeRO and of
tensor parallelism no longer suffices. The momentum stays where ZeRO and tp put it (elementwise, as AdamW's
moments); for each matrix one of the ranks holding pieces of it (its owner) receives the other pieces of U,
orthogonalises it and sends each piece of O back, two all-to-alls over the stage's ranks a step (Megatron's
layer-sharded Muon and owner-and-broadcast designs do the same). Owners are balanced by the matrices' sizes:
largest first, each to the rank holding most of it unless that rank has its share of the work already (see
assign_owners). With N ranks sharing a stage's matrices evenly, a rank sends
about 2 (N-1)/N^2 of their elements a step and runs 1/N of the Newton-Schulz work; the alternative, every
holder gathering every matrix (`--muon-assembly gather`), sends (N-1)/N of them and repeats the work N
times: as many bytes at N = 2, N/2 times more beyond. Copies of a matrix (data-parallel replicas without
ZeRO, hybrid sharding's replicas) are each assembled among their own ranks, as AdamW's step is repeated on
each replica. Everything here is elementwise except the assembled matrix, so every layout gives the single
device's weights.
"""
import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

MOMENTUM = 0.95                      # Jordan's and Moonlight's
QUINTIC = (3.4445, -4.7750, 2.0315)  # Jordan's coefficients: fast growth of small singular values
NEWTON_SCHULZ_STEPS = 5
RMS_MATCH = 0.2                      # Moonlight: the update's RMS, AdamW's typical one
comm_bytes = Counter()               # bytes sent to other ranks, by kind (train.py logs them under "optim")


def newton_schulz(update, steps=NEWTON_SCHULZ_STEPS, dtype=torch.bfloat16):
    """About P Q^T for update = P S Q^T: X <- a X + (b X X^T + c (X X^T)^2) X from X = update / |update|_F,
    an odd polynomial of the singular values that takes each into about [0.68, 1.18] and leaves P and Q
    alone (Jordan et al., 2024: "roughly Uniform(0.5, 1.5)"). Iterated on the wide orientation, whose X X^T
    is the smaller."""
    a, b, c = QUINTIC
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def orthogonalised(update, dtype=torch.bfloat16):
    """Muon's update for one matrix, RMS-matched to AdamW's (Moonlight's equation 4)."""
    return newton_schulz(update, dtype=dtype) * (RMS_MATCH * math.sqrt(max(update.shape)))


def matrix_rows(name, shape, config):
    """The rows of each logical matrix parameter `name` (full `shape`) stacks, top to bottom, or None if
    AdamW updates it: q | k | v in a fused qkv, gate | up in a SwiGLU fc, else one matrix."""
    if not name.startswith("blocks.") or len(shape) != 2 or name.endswith(("router.weight", "shared_gate.weight")):
        return None
    if name.endswith("attn.qkv.weight"):
        return [config.q_dim, config.kv_dim, config.kv_dim]
    if name.endswith("fc.weight") and config.gated:
        return [shape[0] // 2] * 2
    return [shape[0]]


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + end - first) of a rank's piece: elements [first, end) (row-major) of the
    rectangle `size` at `corner` of matrix `key` (of `shape`), whose copy `copy` they belong to."""
    key: str
    copy: int
    shape: tuple
    corner: tuple
    size: tuple
    first: int
    end: int
    start: int = 0

    @property
    def numel(self):
        return self.end - self.first

    def views(self, matrix):
        """The segment's elements of `matrix`, in order, as at most three views: a partial first row, whole
        rows, a partial last row."""
        rows, cols = self.size
        block = matrix[self.corner[0]:self.corner[0] + rows, self.corner[1]:self.corner[1] + cols]
        first_row, head = divmod(self.first, cols)
        last_row, tail = divmod(self.end, cols)
        if first_row == last_row:
            return [block[first_row, head:tail]]
        whole_from = first_row + (head > 0)
        parts = [block[first_row, head:]] if head else []
        parts += [block[whole_from:last_row]] if last_row > whole_from else []
        return parts + ([block[last_row, :tail]] if tail else [])


def rectangles(name, local_shape, rows, split):
    """Each matrix of parameter `name` (row counts `rows`, see matrix_rows) as this rank holds it: [(key, shape,
    first local row, corner, size)]. split: tensor parallelism's (dim, parts, part) of it, or None. A
    column-parallel layer holds a band of each matrix's rows, a row-parallel one a band of its columns."""
    dim, parts, part = split or (0, 1, 0)
    local_cols, out, local_row = local_shape[1], [], 0
    for i, full_rows in enumerate(rows):
        key = f"{name}[{i}]" if len(rows) > 1 else name
        if dim == 0:
            size, corner, shape = (full_rows // parts, local_cols), (part * full_rows // parts, 0), (full_rows, local_cols)
        else:
            size, corner, shape = (full_rows, local_cols), (0, part * local_cols), (full_rows, local_cols * parts)
        out.append((key, shape, local_row, corner, size))
        local_row += size[0]
    return out


def segments(name, local_shape, rows, split, start, end, copy=0):
    """The Segments of elements [start, end) of this rank's flattened `name` (a piece of it ZeRO gave it, or
    all of it), numbered from 0 at start."""
    found = []
    for key, shape, local_row, corner, size in rectangles(name, local_shape, rows, split):
        lo = local_row * local_shape[1]
        first, last = max(start, lo), min(end, lo + size[0] * size[1])
        if first < last:
            found.append(Segment(key, copy, shape, corner, size, first - lo, last - lo, first - start))
    return found


# ---------------------------------------------------------------------------
# Who assembles which matrix (a pure function of what each rank holds: tools/plan/ predicts with it)
# ---------------------------------------------------------------------------

def assign_owners(held, every_holder=False):
    """{(copy, key): [ranks assembling it, the first of which answers the holders that do not]} from held,
    {rank: [Segment]}: every holder (every_holder), or one. Largest matrices first, each to the holder of most
    of it (the least traffic) among those still below their fair share of the copy's work (its matrices'
    elements over the ranks holding them; ties: the least loaded, then the lowest rank); where every holder
    has its share, to the least loaded."""
    holders, sizes = defaultdict(Counter), {}
    for rank, found in held.items():
        for s in found:
            holders[s.copy, s.key][rank] += s.numel
            sizes[s.copy, s.key] = s.shape[0] * s.shape[1]
    if every_holder:
        return {matrix: sorted(ranks) for matrix, ranks in holders.items()}
    work, ranks = Counter(), defaultdict(set)
    for (copy, key), holding in holders.items():
        work[copy] += sizes[copy, key]
        ranks[copy].update(holding)
    load, owners = Counter(), {}
    for matrix in sorted(holders, key=lambda m: (-sizes[m], m)):
        holding = holders[matrix]
        with_room = [r for r in holding if load[r] < work[matrix[0]] / len(ranks[matrix[0]])]
        owner = (min(with_room, key=lambda r: (-holding[r], load[r], r)) if with_room
                 else min(holding, key=lambda r: (load[r], r)))
        owners[matrix], load[owner] = [owner], load[owner] + sizes[matrix]
    return owners


def answerer(owners, rank):
    """Who sends `rank` the orthogonalised pieces of a matrix assembled by `owners`: itself if it is one."""
    return rank if rank in owners else owners[0]


def bytes_sent(held, owners, itemsize):
    """{rank: bytes} a step's two all-to-alls send to other ranks: each segment to each owner but its holder,
    and each owner's answers to the holders that do not assemble the matrix."""
    sent = Counter()
    for rank, found in held.items():
        for s in found:
            ranks = owners[s.copy, s.key]
            sent[rank] += s.numel * itemsize * sum(owner != rank for owner in ranks)
            if answerer(ranks, rank) != rank:
                sent[ranks[0]] += s.numel * itemsize
    return sent


# ---------------------------------------------------------------------------
# The exchange: pieces of U to their owners, pieces of O back
# ---------------------------------------------------------------------------

class Assembly:
    """The matrices of one optimizer's pieces, assembled over `group` (None: one device, every matrix here
    whole): `orthogonalise` takes this rank's pieces of U and gives back its pieces of O.

    `held`: this rank's [Segment] (start: where in the concatenation of its pieces); the ranks' lists are
    gathered once, here, so that each knows every owner and what each rank sends it, in which order."""

    def __init__(self, held, group=None, every_holder=False, dtype=torch.bfloat16, device=None):
        self.group, self.dtype, self.device = group, dtype, device
        self.rank = dist.get_rank(group) if group is not None else 0
        n_ranks = dist.get_world_size(group) if group is not None else 1
        everyone = [held] * n_ranks  # each rank's [Segment], as gathered
        if group is not None:
            dist.all_gather_object(everyone, held, group=group)
        self.owners = assign_owners(dict(enumerate(everyone)), every_holder)
        # outbox[r]: my segments rank r assembles; inbox[r]: rank r's segments I assemble (in its order)
        self.outbox = [[s for s in held if r in self.owners[s.copy, s.key]] for r in range(n_ranks)]
        self.inbox = [[s for s in theirs if self.rank in self.owners[s.copy, s.key]] for theirs in everyone]
        self.answers = [[s for s in box if answerer(self.owners[s.copy, s.key], r) == self.rank]
                        for r, box in enumerate(self.inbox)]
        self.questions = [[s for s in held if answerer(self.owners[s.copy, s.key], self.rank) == r]
                          for r in range(n_ranks)]
        # Whether any rank's answer comes from another (not where every holder assembles: one all-to-all then)
        self.answers_travel = any(answerer(self.owners[s.copy, s.key], r) != r
                                  for r, theirs in enumerate(everyone) for s in theirs)

    def orthogonalise(self, flat):
        """flat: this rank's pieces of U, concatenated; returns its pieces of O in the same places."""
        received = self._all_to_all(self.outbox, self.inbox, lambda s: flat[s.start:s.start + s.numel])
        matrices = {}
        for box, values in zip(self.inbox, received):
            for s, part in zip(box, values.split([s.numel for s in box])):
                matrix = matrices.setdefault((s.copy, s.key), torch.zeros(s.shape, dtype=self.dtype, device=self.device))
                _copy_into(s.views(matrix), part)
        done = {matrix: orthogonalised(u, self.dtype) for matrix, u in matrices.items()}
        answered = self._all_to_all(self.answers, self.questions,
                                    lambda s: torch.cat([v.reshape(-1) for v in s.views(done[s.copy, s.key])]),
                                    travels=self.answers_travel)
        out = torch.empty_like(flat)
        for box, values in zip(self.questions, answered):
            for s, part in zip(box, values.split([s.numel for s in box])):
                out[s.start:s.start + s.numel] = part
        return out

    def _all_to_all(self, send_boxes, receive_boxes, values_of, travels=True):
        """Each rank r the values of send_boxes[r]'s segments; from each rank r those of receive_boxes[r]
        (travels False: every box but this rank's own is empty on every rank, so nothing is sent)."""
        parts = [values_of(s).to(self.dtype) for box in send_boxes for s in box]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        if self.group is None or not travels:
            return [send if r == self.rank else send[:0] for r in range(len(send_boxes))]
        send_splits = [sum(s.numel for s in box) for box in send_boxes]
        receive_splits = [sum(s.numel for s in box) for box in receive_boxes]
        received = torch.empty(sum(receive_splits), dtype=self.dtype, device=self.device)
        dist.all_to_all_single(received, send, receive_splits, send_splits, group=self.group)
        comm_bytes["all_to_all"] += (send.numel() - send_splits[self.rank]) * send.element_size()
        return received.split(receive_splits)


def _copy_into(views, values):
    """values, in order, into the views (a Segment's)."""
    offset = 0
    for view in views:
        view.copy_(values[offset:offset + view.numel()].view(view.shape))
        offset += view.numel()


# ---------------------------------------------------------------------------
# The optimizer of a rank's pieces
# ---------------------------------------------------------------------------

class Muon:
    """The optimizer of this rank's pieces of the weights (each a tensor, flat or whole): Muon on those
    with Segments, make_adamw(the others) on the others (train.py's AdamW), with one learning rate and weight
    decay. It offers what train.py and the checkpoints use of torch.optim's optimizers: state (a piece's
    `momentum_buffer` and `step`, the count the checkpoints keep for every piece, or AdamW's), param_groups,
    step and zero_grad.

    pieces: [(tensor, [Segment])]; assembly: the Assembly of their Segments (the starts in the concatenation
    of the Muon pieces, in order)."""

    def __init__(self, pieces, assembly, make_adamw, lr, weight_decay, momentum=MOMENTUM):
        self.matrices = [(t, found) for t, found in pieces if found]
        others = [t for t, found in pieces if not found]
        self.assembly = assembly
        self.adamw = make_adamw(others) if others else None
        self.state = self.adamw.state if self.adamw else defaultdict(dict)
        muon = dict(params=[t for t, _ in self.matrices], lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.param_groups = [muon, *(self.adamw.param_groups if self.adamw else [])]

    def zero_grad(self, set_to_none=True):  # (to None only, as ReplicatedOptimizer asks)
        for group in self.param_groups:
            for t in group["params"]:
                t.grad = None

    @torch.no_grad()
    def step(self):
        if self.adamw:
            self.adamw.step()
        group = self.param_groups[0]
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        looks = []
        for t, _ in self.matrices:  # a piece without a gradient (no rank used it) sends zeros, and is left alone
            if t.grad is None:
                looks.append(torch.zeros(t.numel(), dtype=t.dtype, device=t.device))
                continue
            state = self.state[t]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(t)
                state["step"] = torch.zeros((), dtype=torch.float32, device=t.device)
            momentum = state["momentum_buffer"]
            momentum.mul_(mu).add_(t.grad)
            state["step"] += 1
            looks.append(t.grad.add(momentum, alpha=mu).reshape(-1))
        if not self.assembly.owners:  # no rank of the group holds a matrix: nothing to exchange
            return
        flat = torch.cat(looks) if looks else torch.empty(0, dtype=self.assembly.dtype, device=self.assembly.device)
        update, offset = self.assembly.orthogonalise(flat), 0
        for t, _ in self.matrices:
            if t.grad is not None:
                t.mul_(1 - lr * decay).add_(update[offset:offset + t.numel()].view_as(t).to(t.dtype), alpha=-lr)
            offset += t.numel()


def held_segments(pieces, shapes, config, split_of=lambda name: None, copy_of=lambda name: 0):
    """[(piece, [Segment])] of an optimizer's pieces [(name, start, end, piece)] (dp.py's `pieces()`), each
    Segment's start counted in the concatenation of the pieces that have any. shapes: {name: this rank's
    shape of it}; split_of(name): tensor parallelism's (dim, parts, part) of a parameter, or None;
    copy_of(name): which copy of it this rank's is (see the module's docstring)."""
    out, offset = [], 0
    for name, start, end, piece in pieces:
        shape, split = shapes[name], split_of(name)
        full = [n * (split[1] if split and split[0] == dim else 1) for dim, n in enumerate(shape)]
        rows = matrix_rows(name, full, config)
        found = segments(name, shape, rows, split, start, end, copy_of(name)) if rows else []
        out.append((piece, [Segment(s.key, s.copy, s.shape, s.corner, s.size, s.first, s.end, s.start + offset)
                            for s in found]))
        offset += end - start if found else 0
    return out


def single_device(model, make_adamw, lr, weight_decay, dtype):
    """Muon and AdamW over a whole model on one device (tools/parity.py's reference): every matrix here whole."""
    named = [(name, 0, p.numel(), p) for name, p in model.named_parameters()]
    pieces = held_segments(named, {name: p.shape for name, _, _, p in named}, model.config)
    held = [s for _, found in pieces for s in found]
    return Muon(pieces, Assembly(held, dtype=dtype, device=named[0][3].device), make_adamw, lr, weight_decay)
