"""Context parallelism: the sequence split over ranks, attention kept exact by ring attention.

The article's "Sequence Parallelism, Flavor 2: Ring Attention" ("5D Parallelism from Scratch"); ring
attention is Liu et al.'s (2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"),
the block merge the online softmax of FlashAttention (Dao et al., 2022, Algorithm 1; Milakov and
Gimelshein, 2018), the zigzag split Llama 3's (Llama Team, 2024, section 3.3.2).

Every layer but attention treats tokens independently, so each of N ranks holds 1/N of the sequence and
runs norms, MLPs and the loss on it alone. Attention needs every earlier key and value: the ranks pass
their K/V blocks round a ring, and each combines its queries with every block as it passes, while the
next block is already on its way. A block's partial output O_b and log-sum-exp L_b are merged into the
running pair (the online softmax), in float32 or better:

    L = log(exp(L) + exp(L_b)),    O = O exp(L_old - L) + O_b exp(L_b - L)

Backward recomputes each block's probabilities from the final L (P = exp(S - L)), and the dK/dV
accumulators travel round the ring with their K/V block until they are home.

First the article: the zigzag split, one block and the merge, ring attention forward and backward on the
block computation written out. After the banner "Beyond the article": what a query sees (packed documents,
sliding windows: blocks cut into tiles of the keys seen, the ring skipping what no query needs; attention
sinks), the all-gather (Llama 3) and all-to-all (DeepSpeed-Ulysses) ways on the same shards, one device's
core, the glue to model.py, PyTorch's fused block kernels, the self-check. Design notes: docs/design-cp.md.

What a model must offer (the contract for copying this file alone): its attention calls a replaceable
function on q, k, v of shape (batch, heads, seq, head_dim) after any rotary embedding (k and v may have
fewer heads: grouped-query attention), and, for packed documents, the document ids (batch, seq) of the
WHOLE sequence in natural order (non-decreasing along a row; None: one causal sequence), by the same seam
the layer's window (int or None) and sinks (a parameter of one logit per head, or None); and it takes
token positions as an argument, so that a rank's shard (`shard_sequence`) is embedded at its true
positions (`zigzag_positions`). The glue is one line per attention layer, `core = ContextParallelCore(group)`
(ring attention on PyTorch's fused kernels; mode="allgather" or "alltoall" for the other ways; on one
device `AttentionCore()`), called as core(q, k, v, documents, window=, sinks=), or `core = lambda q, k, v:
ring_attention(q, k, v, group)[0]` on the written-out blocks; plus sharding the batch. Gradients are then
averaged over the group as data parallelism does.

Self-check: torchrun --nproc_per_node 4 cp.py
"""
import contextlib
import functools
import math
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

comm_bytes = Counter()   # bytes this rank sent, per kind
blocks_computed = Counter()  # attention blocks (pairs of chunks) computed by this rank: "forward", "backward"


# ---------------------------------------------------------------------------
# Zigzag sharding of the sequence
# ---------------------------------------------------------------------------

def zigzag_positions(seq_len, n_ranks, rank, device=None):
    """The positions rank `rank` holds: chunks r and 2N-1-r of 2N equal chunks. Under causal attention the
    last tokens attend to the whole sequence and the first to almost nothing; one early and one late chunk
    give every rank the same work, 2N + 1 (query chunk, key chunk) blocks (`blocks_computed`)."""
    if seq_len % (2 * n_ranks):
        raise ValueError(f"sequence length {seq_len} does not divide into 2 x {n_ranks} context-parallel chunks")
    chunk = seq_len // (2 * n_ranks)
    first, second = rank * chunk, (2 * n_ranks - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


def shard_sequence(x, n_ranks, rank, dim=1):
    """This rank's zigzag shard of x along dim."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], n_ranks, rank, x.device))


def shard_order(seq_len, n_ranks, device=None):
    """The positions of every rank's shard laid end to end in rank order: a rank-ordered sequence x has
    position shard_order[i] at index i, so x.index_select(dim, argsort(shard_order)) is in natural order."""
    return torch.cat([zigzag_positions(seq_len, n_ranks, r) for r in range(n_ranks)]).to(device)


def restore_order(shards, dim=1):
    """The full sequence from every rank's shard (listed in rank order)."""
    seq_len = sum(s.shape[dim] for s in shards)
    order = shard_order(seq_len, len(shards), shards[0].device)
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order))


def chunk_slices(rank, n_ranks, chunk):
    """The sequence indices of rank `rank`'s two chunks, r and 2N-1-r, as slices."""
    return [slice(c * chunk, (c + 1) * chunk) for c in (rank, 2 * n_ranks - 1 - rank)]


# ---------------------------------------------------------------------------
# One block, and merging blocks
# ---------------------------------------------------------------------------

def repeat_kv(t, heads_per_kv):
    """(batch, kv_heads, seq, d) -> (batch, kv_heads * heads_per_kv, seq, d): each key/value head serves
    heads_per_kv consecutive query heads (grouped-query attention)."""
    return t.repeat_interleave(heads_per_kv, dim=1)


def sum_groups(t, heads_per_kv):
    """The gradient of repeat_kv: the repeated heads' gradients summed back onto their key/value head."""
    return t.unflatten(1, (-1, heads_per_kv)).sum(2)


def _widened(t):
    """t in float32, or in its own dtype if that is wider (float64 checks). (model.py's at_least_float32:
    a deliberate copy, each dimension file standing alone.)"""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if isinstance(mask, torch.Tensor):  # within documents: True where a query sees a key
        return scores.masked_fill(~mask, float("-inf"))
    if mask:  # the diagonal block: query i sees keys 0..i
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def block_attention(q, k, v, mask):
    """(output, log-sum-exp) of q against one block of keys and values, written out. Computed in float32 or
    better whatever the inputs' dtype, as the fused kernels keep their softmax. mask: True (causal: queries
    against their own keys), False (none) or, within documents (after the banner), a boolean tensor
    (batch or 1, 1, queries, keys), True where a query sees a key."""
    q, k, v = (_widened(t) for t in (q, k, v))
    scores = _scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def block_attention_backward(grad_out, q, k, v, out, lse, mask):
    """(dQ, dK, dV) of one block, from the merged output and log-sum-exp of the whole row, written out.

    P = exp(S - L) recomputed with the final L is this block's share of the softmax; then
    dV = Pᵀ dO, dS = P (dO Vᵀ - rowsum(dO O)), dQ = dS K / √d, dK = dSᵀ Q / √d. In float32 or better.
    (Every query sees at least itself, so the final L is finite and masked scores give P = 0.)
    """
    grad_out, q, k, v, out = (_widened(t) for t in (grad_out, q, k, v, out))
    p = torch.exp(_scores(q, k, mask) - lse.unsqueeze(-1))
    delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O) = sum_j P_ij dP_ij
    ds = p * (torch.matmul(grad_out, v.transpose(-2, -1)) - delta) / math.sqrt(q.shape[-1])
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-2, -1), q), torch.matmul(p.transpose(-2, -1), grad_out)


def merge(out, lse, block_out, block_lse):
    """Online softmax: fold one block's (output, log-sum-exp) into the running pair, in the running pair's
    dtype (float32 or better: a bfloat16 block output is rounded once, the sum of blocks is not)."""
    block_out, block_lse = block_out.to(out.dtype), block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    rescaled = out * torch.exp(lse - new_lse).unsqueeze(-1)
    return rescaled + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1), new_lse


@contextlib.contextmanager
def precision_as_given(q, k, v):
    """q, k, v of one dtype, and autocast off: under bf16 autocast the written-out blocks' matmuls would run
    in bfloat16 again (and backward, which autocast does not cover, in float32), where each way chooses its
    dtypes explicitly (RingAttention's docstring: FlashAttention's split)."""
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"attention takes q, k, v of one dtype, not {q.dtype}, {k.dtype}, {v.dtype}")
    with torch.autocast(q.device.type, enabled=False):
        yield


# The block kernels, (forward, backward): the written-out computation above, the readable reference and
# every way's default; `default_kernels` (after the banner) picks PyTorch's fused ones, which never hold a
# block's (s/2N)² scores, for a production run.
EXPLICIT = (block_attention, block_attention_backward)


# ---------------------------------------------------------------------------
# Ring attention, forward and backward
# ---------------------------------------------------------------------------

def ring_attention(q, k, v, group, *,  # beyond the article:
                   kernels=EXPLICIT, documents=None, window=None, sinks=None):
    """Causal attention output for this rank's zigzag shard, in q's dtype (and its log-sum-exp, second, in
    float32 or better). kernels: the block computation, written out (EXPLICIT) unless given (FUSED on CPUs,
    CUDA_FLASH, CUDA_EFFICIENT: `default_kernels` picks). After the banner, what a query sees besides the
    causal order: documents, None or (batch, seq) the document id of every token of the whole sequence (not
    sharded), non-decreasing along a row (attention stays within each document); window, a query sees at
    most this many latest tokens, itself included; sinks (heads,), a learned logit per head in the softmax's
    denominator."""
    masks = attention_masks(documents, window, sinks, q.device)
    with precision_as_given(q, k, v):
        out, lse = RingAttention.apply(q, k, v, group, masks.kernels_for(kernels), masks)
    return masks.sink_gradients(out, lse), lse


class RingAttention(torch.autograd.Function):
    """Causal attention of zigzag-sharded q, k, v (batch, heads, local_seq, head_dim) over the ring.
    apply is positional (as every autograd.Function's is): the keyword-only entry is `ring_attention`.

    Two seams beyond the article: kernels, the block computation (forward, backward: `ring_attention`
    defaults to the written-out EXPLICIT), and masks, which blocks are needed, with which mask, and how the
    ring runs (`ring_plan`: under `CausalMasks` every block goes round the whole ring).

    Grouped-query attention: the ring carries k and v with their own fewer heads; each block repeats them to
    the query heads, and backward sums the repeated heads' dK, dV over each group before they travel on.
    Mixed precision, FlashAttention's split: what travels and what the kernels take is in the inputs' dtype
    (in bfloat16 the ring's traffic is half float32's); the merge (output, log-sum-exp) and each rank's sums
    of dQ, dK, dV are in float32 or better (a bfloat16 sum of many blocks would lose their small terms).
    `precision_as_given` keeps autocast out, where these dtypes are chosen explicitly.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, kernels, masks):
        ring, heads_per_kv = _Ring(group), q.shape[1] // k.shape[1]  # query heads per key/value head
        plan = masks.ring_plan(ring.rank, ring.n, q.shape[2] // 2)
        merged = torch.promote_types(q.dtype, torch.float32)  # the running output and log-sum-exp
        qh = q.chunk(2, dim=2)  # the two local chunks
        out = [torch.zeros((*h.shape[:-1], v.shape[-1]), dtype=merged, device=q.device) for h in qh]  # v's width
        lse = [torch.full(h.shape[:-1], float("-inf"), dtype=merged, device=q.device) for h in qh]
        kv = (k, v)  # the block held (sent in its own dtype); None once blocks stop coming this far
        for step in range(ring.n):
            with torch.profiler.record_function(f"cp.ring step {step} forward"):  # named in a profiler's trace
                works, received = ring.pass_block(plan, step, kv, (k, v))  # on its way while this one is computed
                blocks = plan.blocks(step)
                if blocks:
                    kh, vh = (repeat_kv(t, heads_per_kv).chunk(2, dim=2) for t in kv)
                for qi, ki, mask in blocks:
                    block_out, block_lse = kernels[0](qh[qi], kh[ki], vh[ki], mask)
                    out[qi], lse[qi] = merge(out[qi], lse[qi], block_out, block_lse)
                    blocks_computed["forward"] += 1
                _wait(works)
                kv = received[0] if received else None
        out, lse = masks.with_sinks(torch.cat(out, dim=2), torch.cat(lse, dim=2))  # (beyond the article)
        # The output is kept in the inputs' dtype (the fused backward kernels take it so; the reference
        # widens it again), the log-sum-exp in float32 or better: an error e in L is a relative error e
        # in every P = exp(S - L) that backward recomputes from it.
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernels, ctx.plan = group, kernels, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plan, heads_per_kv = _Ring(ctx.group), ctx.plan, q.shape[1] // k.shape[1]
        summed = lse.dtype  # float32 or better: this rank's sums of block gradients
        qh, d_out, oh, lh = (t.chunk(2, dim=2) for t in (q, grad_out, out, lse))
        dq = [torch.zeros(h.shape, dtype=summed, device=q.device) for h in qh]
        kv = (k, v)
        pending, from_prev, home = [], None, None  # last step's accumulator batch, what it brought, this rank's own
        # The K/V blocks go round the ring again, as in forward, and each travels with its dK/dV
        # accumulators: at every step a rank adds its queries' share to the accumulators of the block it
        # holds and passes both on, so a block's accumulators have every rank's share when they reach its
        # home rank, one hop after the last. (dQ stays here: this rank's queries.)
        for step in range(ring.n):
            with torch.profiler.record_function(f"cp.ring step {step} backward"):
                works, received = ring.pass_block(plan, step, kv, (k, v))
                grad_acc = RingAttention._block_gradients(ctx.kernels[1], plan.blocks(step), kv, (d_out, qh, oh, lh),
                                                          dq, heads_per_kv)
                _wait(pending)
                if from_prev is not None:  # the accumulators of this block, from the ranks it visited before
                    grad_acc = (from_prev if grad_acc is None  # a relay (within documents): it needed nothing of it
                                else tuple(a.to(summed) + c for a, c in zip(from_prev, grad_acc)))
                pending, from_prev, home = RingAttention._pass_gradients(ring, plan, step, grad_acc, (k, v), home)
                _wait(works)
                kv = received[0] if received else None
        _wait(pending)
        return torch.cat(dq, dim=2).to(q.dtype), home[0], home[1], None, None, None

    @staticmethod
    def _block_gradients(kernel, blocks, kv, rows, dq, heads_per_kv):
        """Add `blocks`' dQ to dq (this rank's two chunks) and return their dK, dV of the held K/V block,
        summed over each group's query heads, in dq's dtype: None if there are no blocks. rows: (dO, Q, O,
        L) of this rank's two chunks."""
        if not blocks:
            return None
        d_out, qh, oh, lh = rows
        kh, vh = (repeat_kv(t, heads_per_kv).chunk(2, dim=2) for t in kv)
        dk, dv = ([torch.zeros(h.shape, dtype=dq[0].dtype, device=h.device) for h in hs] for hs in (kh, vh))
        for qi, ki, mask in blocks:
            block_dq, block_dk, block_dv = kernel(d_out[qi], qh[qi], kh[ki], vh[ki], oh[qi], lh[qi], mask)
            dq[qi] += block_dq
            dk[ki] += block_dk
            dv[ki] += block_dv
            blocks_computed["backward"] += 1
        return sum_groups(torch.cat(dk, dim=2), heads_per_kv), sum_groups(torch.cat(dv, dim=2), heads_per_kv)

    @staticmethod
    def _pass_gradients(ring, plan, step, grad_acc, kv, home):
        """Post this step's accumulator exchange: the held block's accumulators (grad_acc, None if no block is
        held) on to the next rank or home, and receive the previous rank's and this rank's own coming home.
        The accumulators travel in K's and V's dtype, as K and V do: in bfloat16 half the bytes, at one
        rounding (2^-8 relative) per hop. (works, the previous rank's accumulators or None, this rank's own
        dK and dV once known)."""
        sends = []
        if grad_acc is not None:
            grad_acc = tuple(a.to(t.dtype) for a, t in zip(grad_acc, kv))
            to = plan.gradients_to(step)
            if to is None:  # no other rank needed this rank's block: its gradients are home already
                home = grad_acc
            else:
                sends.append((grad_acc, to))
        sender = plan.home_from(step)
        receives = ([(kv, ring.prev)] if plan.receives(step) else []) + ([(kv, sender)] if sender is not None else [])
        works, received = ring.post(sends, receives)
        from_prev = received[0] if plan.receives(step) else None
        return works, from_prev, received[-1] if sender is not None else home


class CausalMasks:
    """Plain causal attention, query i sees keys 0..i: the blocks the ways cut (a run of queries against a
    run of keys, slices of sequence indices) are queries against their own keys (mask True, the causal
    mask), against keys all before them (False: every key seen) or all after them (None: skipped).
    (`VisibleMasks`, after the banner, answers the same questions within documents and windows.)"""

    def sees(self, queries, keys):
        """Whether any query of the block sees any of its keys: there are keys, and not all after the queries."""
        return keys.start < min(keys.stop, queries.stop)

    def mask(self, queries, keys):
        if not self.sees(queries, keys):
            return None
        if keys == queries:
            return True
        if keys.stop - 1 <= queries.start:
            return False
        raise ValueError(f"keys {keys} are neither the queries' own ({queries}) nor all before them")

    def ring_plan(self, rank, n_ranks, chunk):
        return RingPlan(self, rank, n_ranks, chunk)

    @staticmethod
    def kernels_for(kernels):
        """The block kernels as these masks need them: as given (every query of a causal block sees a key)."""
        return kernels

    def with_sinks(self, out, lse):
        """The merged (output, log-sum-exp) with the heads' sinks merged in: none here (`WithSinks`, after
        the banner, has them)."""
        return out, lse

    def sink_gradients(self, out, lse):
        """out, through which the sinks get their gradients: none here (`WithSinks`)."""
        return out


class RingPlan:
    """Which blocks this rank computes at each step of one call, and where the ring's messages go. Under
    plain causal attention a rank's late chunk comes after every rank's early one, so every rank needs every
    block: each K/V block goes the whole ring (N-1 hops, each rank passing on what it holds), and its dK/dV
    accumulators follow it, picking up each rank's share, one hop more: home. (`_RingPlan`, after the
    banner, sends a block only as far as a rank needs it.)"""

    def __init__(self, masks, rank, n_ranks, chunk):
        self.masks, self.rank, self.n, self.chunk = masks, rank, n_ranks, chunk

    def source(self, step):
        """Whose block this rank holds at `step`."""
        return (self.rank - step) % self.n

    def blocks(self, step):
        """(query half, key half, mask) of every block this rank computes at `step`: the pairs of this rank's
        chunks and the held block's that the masks do not skip."""
        q_chunks, k_chunks = (chunk_slices(r, self.n, self.chunk) for r in (self.rank, self.source(step)))
        masks = [(qi, ki, self.masks.mask(q_chunks[qi], k_chunks[ki])) for qi in range(2) for ki in range(2)]
        return [(qi, ki, mask) for qi, ki, mask in masks if mask is not None]

    def passes_on(self, step):
        """Whether this rank sends the block it holds at `step` on to the next rank."""
        return step < self.n - 1

    def receives(self, step):
        """Whether the previous rank passes its block of `step` on to this one."""
        return step < self.n - 1

    def gradients_to(self, step):
        """Where the accumulators of the block held at `step` go once this rank's share is added: the next
        rank (after the last step, the block's home); None on a ring of one (they are home)."""
        return (self.rank + 1) % self.n if self.n > 1 else None

    def home_from(self, step):
        """The rank this rank's own accumulators come home from at `step` (the previous one, after the last
        step), or None."""
        return (self.rank - 1) % self.n if step == self.n - 1 > 0 else None


class _Ring:
    """Point-to-point messages between the ranks of a group (by group rank), posted in batches and waited on
    later. Messages match by order alone, as NCCL requires (it ignores tags): every rank runs the same loop,
    posting at each step one batch that passes a set of tensors to the next rank and receives a set of the
    same shapes from the previous one, so the n-th message from a rank is the n-th receive its successor
    posts from it, and step s completes once every rank has reached it (more in docs/design-cp.md)."""

    def __init__(self, group):
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        self.world = group or dist.group.WORLD

    def post(self, sends=(), receives=()):
        """Post sends [(tensors, to rank)], then receives [(tensors shaped like, from rank)], in one batch:
        (works, the received tensors of each receive)."""
        ops, received = [], []
        for tensors, peer in sends:
            tensors = [t.contiguous() for t in tensors]
            ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(self.world, peer), self.group) for t in tensors]
            comm_bytes["send_recv"] += sum(t.numel() * t.element_size() for t in tensors)
        for like, peer in receives:
            received.append([torch.empty_like(t, memory_format=torch.contiguous_format) for t in like])
            ops += [dist.P2POp(dist.irecv, r, dist.get_global_rank(self.world, peer), self.group) for r in received[-1]]
        return (dist.batch_isend_irecv(ops) if ops else []), received

    def pass_block(self, plan, step, kv, like):
        """Post this step's K/V exchange: the held block on to the next rank, the previous rank's from it."""
        return self.post(sends=[(kv, self.next)] if plan.passes_on(step) else [],
                         receives=[(like, self.prev)] if plan.receives(step) else [])


def _wait(works):
    for work in works:
        work.wait()


# ---- Beyond the article ----

# ---------------------------------------------------------------------------
# What a query sees: packed documents, sliding windows (tiles of the blocks), sinks
# ---------------------------------------------------------------------------
#
# A sequence may hold several documents back to back, and a layer may have a sliding window: query i then
# sees keys lo[i]..i, lo[i] the later of its document's first token and i - window + 1. Every way takes the
# document ids of the whole sequence (every rank has all of them), so a rank knows what any query sees
# without asking; ring attention plans from them, alike on every rank, which blocks and messages no query
# needs (`_RingPlan`). Within a block, only the tiles that hold a seen key are computed (`VisibleMasks`): a
# packed sequence of short documents, or a short window, costs what its visible pairs cost, not the causal
# triangle, and no (seq, seq) mask exists. What is not skipped: docs/design-cp.md.

def attention_masks(documents, window=None, sinks=None, device=None):
    """What each block of this call computes: plain causal attention (documents and window None), or the
    tiles of what a query sees (`VisibleMasks`, its masks made on `device`, the queries'); with sinks
    (heads,), each head's sink merged in."""
    if documents is None and window is None:
        masks = CausalMasks()
    else:
        masks = _visible_masks(documents, window, documents.device if documents is not None else device)
    return masks if sinks is None else WithSinks(masks, sinks)


@functools.lru_cache(maxsize=8)  # (a tensor hashes by identity; a cached one is held, so none can alias it)
def _visible_masks(documents, window, device):
    """Every layer of a micro-batch asks with the same ids tensor: its masks (one per window) are kept and
    given again, so the ids go to the host once per micro-batch, not once per layer (on a GPU each copy
    makes the host wait for the device)."""
    return VisibleMasks(first_keys(documents), window, device)


@functools.lru_cache(maxsize=8)
def first_keys(documents):
    """The index of the first token of each token's document, (batch, seq), on the ids' device; None without
    documents."""
    if documents is None:
        return None
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.where(starts, index, 0).cummax(dim=1).values
    return first


class VisibleMasks(CausalMasks):
    """Causal attention within packed documents and/or a sliding window: query i sees keys lo[i]..i, lo[i] =
    max(first[i], i - window + 1), first[i] its document's first token (first: `first_keys`, None: one
    document a row; window None: no window); the masks are made on `device`.

    lo does not decrease along a row, so queries qs..qe-1 together see keys of at most lo[qs]..qe-1:
    whether a block sees anything, and which keys each tile of its queries needs, is decided on the host
    from lo's smallest and largest values over the rows (`first_key`). A block's "mask" is its tiles: runs of
    `tile` queries, each against the run of keys it sees, cut where the mask changes kind (`_runs`), each
    with its own mask (True: causal, the tile's own keys; False: all of them; else a boolean tensor, True
    where a query sees a key, made on the ids' device when asked for, again in backward). `kernels_for`
    runs the block kernels tile by tile.
    """
    tile = 128  # queries per tile: the fastest measured on CPUs at 8192 tokens (docs/documents.md)

    def __init__(self, first, window, device=None):
        self.window, self.device = window, device
        self.first = first
        # lo's smallest and largest value over the rows, at each query (host lists: asked per tile)
        self.low, self.high = [None, None] if first is None else torch.stack(
            [first.min(0).values, first.max(0).values]).cpu().tolist()  # one copy to the host

    def first_key(self, i, in_every_row=False):
        """The first key query i sees in some row (in_every_row: the first it sees in every row, the latest)."""
        first = self.high if in_every_row else self.low
        return max(0 if first is None else first[i], 0 if self.window is None else i - self.window + 1)

    def sees(self, queries, keys):
        """Whether any query of the block sees any of its keys: the first query at or after the keys' start
        sees the block's keys if any query does."""
        i = max(queries.start, keys.start)
        return i < queries.stop and keys.start < keys.stop and self.first_key(i) < keys.stop

    def mask(self, queries, keys):
        """The block's tiles [(rows, columns, mask)], slices within the block's queries and keys; None if none."""
        tiles = []
        for start in range(queries.start, queries.stop, self.tile):
            rows = slice(start, min(start + self.tile, queries.stop))
            seen = slice(max(keys.start, self.first_key(start)), min(keys.stop, rows.stop))
            for run in self._runs(rows, seen):
                tiles.append((slice(rows.start - queries.start, rows.stop - queries.start),
                              slice(run.start - keys.start, run.stop - keys.start), self._tile_mask(rows, run)))
        return tiles or None

    def _runs(self, rows, seen):
        """The keys `seen` by some query of `rows`, in up to three runs: those only some of them see (the
        starts of their documents and windows), those every one of them sees (no mask), and the rows' own
        keys (the causal mask, where nothing else masks them); in one run (one mask) where the second would
        be shorter than a tile, whose kernel call would cost more than the mask it saves."""
        every = min(max(seen.start, self.first_key(rows.stop - 1, in_every_row=True)), seen.stop)  # all see from here
        own = min(max(every, rows.start), seen.stop)  # ... to the rows' own keys
        runs = [slice(seen.start, every), slice(every, own), slice(own, seen.stop)] if own - every >= self.tile \
            else [seen]
        return [run for run in runs if run.start < run.stop]

    def _tile_mask(self, queries, keys):
        if self.first_key(queries.stop - 1, in_every_row=True) <= keys.start:  # no document or window starts later
            if keys.stop - 1 <= queries.start:
                return False
            if keys == queries:
                return True
        index = torch.arange(keys.start, keys.stop, device=self.device)
        at = torch.arange(queries.start, queries.stop, device=self.device).unsqueeze(1)
        lo = self.first[:, queries, None] if self.first is not None else torch.zeros(1, 1, 1, device=self.device).long()
        if self.window is not None:
            lo = torch.maximum(lo, at - self.window + 1)
        return ((index <= at) & (index >= lo)).unsqueeze(1)  # (batch or 1, 1, queries, keys)

    def ring_plan(self, rank, n_ranks, chunk):
        return _RingPlan(self, rank, n_ranks, chunk)

    @staticmethod
    def kernels_for(kernels):
        """The block kernels run tile by tile (`_tiled`)."""
        return _tiled(kernels)


def _tiled(kernels):
    """(forward, backward) over a block's tiles by the block kernels `kernels`: the tiles' outputs and
    log-sum-exps merged into their rows', and each tile's share of dQ, dK, dV. Rows that see no key (of no
    tile, or of their tile's mask) get output 0 and the lowest finite log-sum-exp (`_without_keyless_rows`)."""
    forward, backward = kernels

    def tiled_forward(q, k, v, tiles):
        if len(tiles) == 1 and tiles[0][0] == slice(0, q.shape[2]):  # one tile, the whole block's queries
            _, columns, mask = tiles[0]
            return _without_keyless_rows(*forward(q, k[:, :, columns], v[:, :, columns], mask), mask)
        merged = torch.promote_types(q.dtype, torch.float32)
        # token-major, (batch, queries, heads, features) in memory, as the fused kernels lay their outputs
        out = torch.zeros((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), dtype=merged, device=q.device)
        out = out.transpose(1, 2)
        lse = torch.full(q.shape[:-1], torch.finfo(merged).min, dtype=merged, device=q.device)
        written = None  # the rows the last tile wrote: the next tile of the same rows is merged into them
        for rows, columns, mask in tiles:
            tile_out, tile_lse = _without_keyless_rows(*forward(q[:, :, rows], k[:, :, columns], v[:, :, columns],
                                                                mask), mask)
            if rows == written:
                tile_out, tile_lse = merge(out[:, :, rows], lse[:, :, rows], tile_out, tile_lse)
            out[:, :, rows], lse[:, :, rows], written = tile_out, tile_lse, rows
        return out, lse

    def tiled_backward(d_out, q, k, v, out, lse, tiles):
        if len(tiles) == 1 and tiles[0][:2] == (slice(0, q.shape[2]), slice(0, k.shape[2])):  # the block whole
            return backward(d_out, q, k, v, out, lse, tiles[0][2])
        summed = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros(t.shape, dtype=summed, device=t.device) for t in (q, k, v))
        for rows, columns, mask in tiles:
            tile_dq, tile_dk, tile_dv = backward(d_out[:, :, rows], q[:, :, rows], k[:, :, columns], v[:, :, columns],
                                                 out[:, :, rows], lse[:, :, rows], mask)
            dq[:, :, rows] += tile_dq
            dk[:, :, columns] += tile_dk
            dv[:, :, columns] += tile_dv
        return dq, dk, dv

    return tiled_forward, tiled_backward


def _without_keyless_rows(out, lse, mask):
    """A tile's (output, log-sum-exp) with the rows its mask lets see no key set to 0 and to the lowest finite
    value, standing in for log 0 = -inf: merging two -inf would be inf - inf (NaN), and each kernel leaves its
    own values there (the reference NaN; the CPU kernel a log-sum-exp of 0, which the merge would count as a
    weight of 1). Plain causal masks (True or False) have no such rows."""
    if not isinstance(mask, torch.Tensor):
        return out, lse
    keyless = ~mask.any(dim=-1)  # (batch or 1, 1, queries)
    return out.masked_fill(keyless.unsqueeze(-1), 0), lse.masked_fill(keyless, torch.finfo(lse.dtype).min)


class WithSinks:
    """`masks` with attention sinks (gpt-oss): a learned logit per head, sinks (heads,), in every query's
    softmax denominator, so that a query may give part of its attention to nothing. A sink is a block whose
    output is 0 and whose log-sum-exp is the sink: merged once per row (`with_sinks`) into the output and
    log-sum-exp the blocks made, which backward then recomputes every block's probabilities from (so dQ, dK,
    dV account for it), and its own gradient, dL/dsink = -sum over rows of exp(sink - L) rowsum(dO * O)
    (`_SinkGradient`). Anything else is masks'."""

    def __init__(self, masks, sinks):
        self.masks, self.sinks = masks, sinks

    def __getattr__(self, name):
        return getattr(self.masks, name)

    def with_sinks(self, out, lse):
        sink = self.sinks.detach().to(lse.dtype).view(-1, 1).expand_as(lse)
        return merge(out, lse, torch.zeros_like(out), sink)

    def sink_gradients(self, out, lse):
        return _SinkGradient.apply(out, lse, self.sinks)


class _SinkGradient(torch.autograd.Function):
    """out unchanged forward; backward, the sinks' gradient from it and its log-sum-exp (those the sinks were
    merged into; out's own autograd Function hands the gradient of its output on as is)."""

    @staticmethod
    def forward(ctx, out, lse, sinks):
        ctx.save_for_backward(out, lse, sinks)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        out, lse, sinks = ctx.saved_tensors
        p_sink = torch.exp(sinks.to(lse.dtype).view(-1, 1) - lse)  # (batch, heads, queries)
        d_sinks = -(p_sink * (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)).sum((0, 2))
        return grad_out, None, d_sinks.to(sinks.dtype)


class _RingPlan(RingPlan):
    """RingPlan within documents: a pair of chunks whose mask sees nothing is not computed (`RingPlan.blocks`
    asks the masks), and a K/V block goes only as far round the ring as it is needed: block j travels
    hops[j] steps, to the furthest rank ahead of it that sees any of its keys (0: no other rank does, it
    never leaves), through the ranks between whether they need it or not; its dK/dV accumulators come home
    from there in one message instead of round the rest of the ring. Every rank computes hops from the same
    ids, so the sender and the receiver of a message both post it or neither does (then a rank may post
    nothing in a call: on NCCL create the process group bound to a device, as the self-check does).
    """

    def __init__(self, masks, rank, n_ranks, chunk):
        super().__init__(masks, rank, n_ranks, chunk)
        self.hops = [max(t for t in range(n_ranks) if self._sees((j + t) % n_ranks, j)) for j in range(n_ranks)]

    def _sees(self, rank, source):
        """Whether any query of `rank` sees any key of `source`'s block."""
        return any(self.masks.sees(q, k) for q in chunk_slices(rank, self.n, self.chunk)
                   for k in chunk_slices(source, self.n, self.chunk))

    def blocks(self, step):
        """RingPlan's blocks, none if the block of this step never came this far."""
        return super().blocks(step) if step <= self.hops[self.source(step)] else []

    def passes_on(self, step, rank=None):
        """Whether `rank` (default this one) sends the block it holds at `step` on to the next rank."""
        rank = self.rank if rank is None else rank
        return step < self.hops[(rank - step) % self.n]

    def receives(self, step):
        return self.passes_on(step, (self.rank - 1) % self.n)

    def gradients_to(self, step):
        """On with the block to the next rank; from the furthest rank that needed it straight home (the ring's
        own last hop when that rank is the previous one); None if they never left home."""
        hops = self.hops[self.source(step)]
        if step < hops:
            return (self.rank + 1) % self.n
        return self.source(step) if hops else None

    def home_from(self, step):
        hops = self.hops[self.rank]
        return (self.rank + hops) % self.n if step == hops > 0 else None

# ---------------------------------------------------------------------------
# The second way: every rank gathers the whole sequence's keys and values (Llama 3's long-context stage)
# ---------------------------------------------------------------------------
#
# K and V are all-gathered (with grouped-query attention they are the small ones), and each local query
# chunk c (of length C) attends to the keys before it in one block, [0, cC), and to its own chunk with
# the causal mask: two blocks merged as above, no ring steps. Backward gathers K and V again (the forward
# keeps only this rank's shards, as ring attention does, so both hold the same activations) and
# reduce-scatters dK and dV back to the ranks whose shards they are. Bytes a rank sends per layer, with
# kv the bytes of this rank's K (or V) shard:
#   forward   all-gather of K and V                  2 (N-1) kv   (the ring's N-1 passes of K and V)
#   backward  all-gather again, reduce-scatter dK dV  4 (N-1) kv   (the ring's: 2 (N-1) kv + 2 N kv)
# but as a few large collectives, not N-1 exchanges, and with the whole sequence's K and V held during
# the attention (2 N kv bytes, repeated to the query heads inside each block).

# (the flat collectives under their newer names where this PyTorch has them)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_sequence(x, group, order):
    """(batch, heads, seq/N, d) shards of every rank -> (batch, heads, seq, d) in natural order."""
    n = dist.get_world_size(group)
    by_rank = torch.empty((n * x.shape[2], *x.shape[:2], x.shape[3]), dtype=x.dtype, device=x.device)
    all_gather_flat(by_rank, x.movedim(2, 0).contiguous(), group=group)  # sequence first: flat per rank
    comm_bytes["all_gather"] += (n - 1) * x.numel() * x.element_size()
    return by_rank.movedim(0, 2).index_select(2, torch.argsort(order))


def _reduce_scatter_sequence(x, group, order):
    """(batch, heads, seq, d) partial sums on every rank -> this rank's (batch, heads, seq/N, d) shard of their sum."""
    n = dist.get_world_size(group)
    by_rank = x.index_select(2, order).movedim(2, 0).contiguous()
    mine = torch.empty((by_rank.shape[0] // n, *by_rank.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(mine, by_rank, group=group)
    comm_bytes["reduce_scatter"] += (n - 1) * mine.numel() * mine.element_size()
    return mine.movedim(0, 2)


def _prefix_and_diagonal(rank, n_ranks, chunk):
    """For this rank's two query chunks: [(query half, keys before it, its own keys)] as slices of the
    whole sequence's keys: chunk c sees [0, cC) whole and [cC, (c+1)C) causally."""
    halves = []
    for qi, c in enumerate((rank, 2 * n_ranks - 1 - rank)):
        halves.append((qi, slice(0, c * chunk), slice(c * chunk, (c + 1) * chunk)))
    return halves


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of zigzag-sharded q, k, v (batch, heads, local_seq, head_dim), K and V all-gathered,
    within documents if `masks` says so. Mixed precision as RingAttention: K, V and dK, dV travel in the
    inputs' dtype, merges and sums in float32 or better."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernels, masks):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        order, heads_per_kv = shard_order(n * q.shape[2], n, q.device), q.shape[1] // k.shape[1]
        k_all, v_all = (repeat_kv(_gather_sequence(t, group, order), heads_per_kv) for t in (k, v))
        merged, qh = torch.promote_types(q.dtype, torch.float32), q.chunk(2, dim=2)
        out, lse = [None, None], [None, None]
        for qi, before, own in _prefix_and_diagonal(rank, n, qh[0].shape[2]):
            # Its own keys first: every query sees itself, so each row's log-sum-exp is finite before the
            # merge (a row that sees none of the keys before it then merges as weight 0).
            own_mask, before_mask = masks.mask(own, own), masks.mask(own, before)
            out[qi], lse[qi] = (t.to(merged) for t in kernels[0](qh[qi], k_all[:, :, own], v_all[:, :, own],
                                                                 own_mask))
            if before_mask is not None:  # the first chunk has no keys before it (within documents: may see none)
                out[qi], lse[qi] = merge(out[qi], lse[qi], *kernels[0](qh[qi], k_all[:, :, before],
                                                                       v_all[:, :, before], before_mask))
        out, lse = masks.with_sinks(torch.cat(out, dim=2), torch.cat(lse, dim=2))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernels, ctx.masks = group, kernels, masks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        order, heads_per_kv = shard_order(n * q.shape[2], n, q.device), q.shape[1] // k.shape[1]
        k_all, v_all = (repeat_kv(_gather_sequence(t, ctx.group, order), heads_per_kv) for t in (k, v))
        summed = lse.dtype
        qh, d_out, oh, lh = (t.chunk(2, dim=2) for t in (q, grad_out, out, lse))
        dq = [torch.zeros(h.shape, dtype=summed, device=q.device) for h in qh]
        dk, dv = (torch.zeros(t.shape, dtype=summed, device=q.device) for t in (k_all, v_all))
        for qi, before, own in _prefix_and_diagonal(rank, n, qh[0].shape[2]):
            for keys in (own, before):
                mask = ctx.masks.mask(own, keys)
                if mask is not None:
                    block = ctx.kernels[1](d_out[qi], qh[qi], k_all[:, :, keys], v_all[:, :, keys], oh[qi], lh[qi],
                                           mask)
                    dq[qi] += block[0]
                    dk[:, :, keys] += block[1]
                    dv[:, :, keys] += block[2]
        dk, dv = (_reduce_scatter_sequence(sum_groups(t, heads_per_kv).to(k.dtype), ctx.group, order)
                  for t in (dk, dv))
        return torch.cat(dq, dim=2).to(q.dtype), dk, dv, None, None, None


def all_gather_attention(q, k, v, group, *,  # beyond the article:
                         kernels=EXPLICIT, documents=None, window=None, sinks=None):
    """ring_attention's result by all-gathering K and V instead of passing them round a ring."""
    masks = attention_masks(documents, window, sinks, q.device)
    with precision_as_given(q, k, v):
        out, lse = AllGatherAttention.apply(q, k, v, group, masks.kernels_for(kernels), masks)
    return masks.sink_gradients(out, lse), lse


# ---------------------------------------------------------------------------
# The third way: all-to-all from sequence shards to head shards (DeepSpeed-Ulysses)
# ---------------------------------------------------------------------------
#
# Jacobs et al. (2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
# Sequence Transformer Models"): attention is independent per head, so one all-to-all turns each rank's
# 1/N of the sequence with every head into the whole sequence with 1/N of the heads; each rank runs
# ordinary causal attention on those, and a second all-to-all turns the output back. N must divide the
# heads, and the key/value heads under grouped-query attention (each rank takes whole groups). Bytes a
# rank sends per layer, with kv (and q) the bytes of this rank's K (Q) shard:
#   forward   q, k, v in, the output back    (N-1)/N (2 q + 2 kv)
#   backward  their gradients, the same      (N-1)/N (2 q + 2 kv)
# which do not grow with N (the ring's and the all-gather's grow as N-1): with many ranks, the cheapest
# way, as long as the heads go round. During the attention a rank holds the whole sequence on heads/N
# heads: as many bytes as its shard on every head, and no partial outputs to merge.

def _all_to_all(x, group):
    """x (N, ...): part j goes to rank j, and part j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    n = dist.get_world_size(group)
    comm_bytes["all_to_all"] += (n - 1) * x[0].numel() * x.element_size()
    return out


def sequence_to_heads(x, group):
    """(batch, heads, seq/N, d) zigzag shards -> (batch, heads/N, seq, d) in natural order: rank r's heads."""
    n, (b, h, s, d) = dist.get_world_size(group), x.shape
    parts = _all_to_all(x.unflatten(1, (n, h // n)).movedim(1, 0), group)  # (N from, b, h/N, s/N, d)
    by_rank = parts.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
    return by_rank.index_select(2, torch.argsort(shard_order(n * s, n, x.device)))


def heads_to_sequence(x, group):
    """The inverse of sequence_to_heads: (batch, heads/N, seq, d) -> this rank's (batch, heads, seq/N, d)."""
    n, (b, h, s, d) = dist.get_world_size(group), x.shape
    by_rank = x.index_select(2, shard_order(s, n, x.device)).unflatten(2, (n, s // n))
    parts = _all_to_all(by_rank.permute(2, 0, 1, 3, 4), group)  # (N from: their heads, b, h/N, s/N, d)
    return parts.movedim(0, 1).reshape(b, n * h, s // n, d)


class Relayout(torch.autograd.Function):
    """x in the other layout by `there` (sequence_to_heads or heads_to_sequence), whose gradient goes `back`
    by the other: an all-to-all's transpose is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.group), None, None, None


class CausalAttention(torch.autograd.Function):
    """Causal attention of a whole sequence (in natural order) on one device, by the block kernels: one
    block, or within documents and windows the tiles of it that a query sees (`VisibleMasks`), with sinks
    if `masks` has them. It keeps what ring attention keeps (q, k, v, the output and the log-sum-exp: on
    head shards the same sizes as its sequence shards; the masks are made again in backward)."""

    @staticmethod
    def forward(ctx, q, k, v, kernels, masks):
        heads_per_kv, whole = q.shape[1] // k.shape[1], slice(0, q.shape[2])
        out, lse = kernels[0](q, repeat_kv(k, heads_per_kv), repeat_kv(v, heads_per_kv), masks.mask(whole, whole))
        out, lse = masks.with_sinks(out, lse.to(torch.promote_types(q.dtype, torch.float32)))
        out = _token_major(out.to(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.masks = kernels, masks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        heads_per_kv, whole = q.shape[1] // k.shape[1], slice(0, q.shape[2])
        dq, dk, dv = ctx.kernels[1](grad_out, q, repeat_kv(k, heads_per_kv), repeat_kv(v, heads_per_kv), out, lse,
                                    ctx.masks.mask(whole, whole))
        return (dq.to(q.dtype), sum_groups(dk, heads_per_kv).to(k.dtype), sum_groups(dv, heads_per_kv).to(v.dtype),
                None, None)


def _token_major(x):
    """x (batch, heads, seq, features) laid out (batch, seq, heads, features) in memory, as a model's output
    projection reads the heads' outputs (in place, no copy of its own to keep); a copy only if it is not."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def one_device_attention(q, k, v, *, kernels=EXPLICIT, documents=None, window=None, sinks=None):
    """ring_attention's result for a whole sequence on one device, (output, log-sum-exp): the single device's
    attention core, computing only the tiles a query sees (CausalAttention), and the all-to-all's."""
    masks = attention_masks(documents, window, sinks, q.device)
    with precision_as_given(q, k, v):
        out, lse = CausalAttention.apply(q, k, v, masks.kernels_for(kernels), masks)
    return masks.sink_gradients(out, lse), lse


def all_to_all_attention(q, k, v, group, *,  # beyond the article:
                         kernels=EXPLICIT, documents=None, window=None, sinks=None):
    """ring_attention's output by DeepSpeed-Ulysses: to head shards, attention, back to sequence shards
    (and the log-sum-exp of this rank's heads over the whole sequence, second). The head shards hold the
    sequence in natural order (sequence_to_heads puts it so), where documents' ids index it directly; a
    rank's heads are the r-th of N runs of them, and so are their sinks."""
    n = dist.get_world_size(group)
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"all-to-all attention splits the heads over {n} ranks: {q.shape[1]} query and "
                         f"{k.shape[1]} key/value heads do not divide")
    on_heads = (Relayout.apply(t, group, sequence_to_heads, heads_to_sequence) for t in (q, k, v))
    own_sinks = None if sinks is None else sinks.chunk(n)[dist.get_rank(group)]
    out, lse = one_device_attention(*on_heads, kernels=kernels, documents=documents, window=window, sinks=own_sinks)
    return Relayout.apply(out, group, heads_to_sequence, sequence_to_heads), lse


# ---------------------------------------------------------------------------
# Applying it to model.py's GPT (the only model knowledge in this file)
# ---------------------------------------------------------------------------

MODES = {"ring": ring_attention, "allgather": all_gather_attention, "alltoall": all_to_all_attention}


class AttentionCore:
    """A drop-in for model.causal_attention on one device: `one_device_attention` on the fused block kernels
    (`default_kernels`), computing only the tiles a query sees; called as core(q, k, v, documents, window=,
    sinks=), documents the whole sequence's document ids or None."""

    def __call__(self, q, k, v, documents=None, window=None, sinks=None):
        kernels = default_kernels(q.device, q.dtype, q.shape[-1], v.shape[-1])
        return one_device_attention(q, k, v, kernels=kernels, documents=documents, window=window, sinks=sinks)[0]


class ContextParallelCore:
    """AttentionCore on zigzag-sharded sequences, by one of the three ways on the fused block kernels (the
    production path; the ways' own default is the written-out blocks)."""

    def __init__(self, group, mode="ring"):
        self.group, self.attention = group, MODES[mode]

    def __call__(self, q, k, v, documents=None, window=None, sinks=None):
        kernels = default_kernels(q.device, q.dtype, q.shape[-1], v.shape[-1])
        return self.attention(q, k, v, self.group, kernels=kernels, documents=documents, window=window,
                              sinks=sinks)[0]


def apply_context_parallel(model, group, mode="ring"):
    """Give every attention layer a context-parallel core (ring, allgather or alltoall); the caller shards
    tokens and positions."""
    n = dist.get_world_size(group)
    if model.config.seq_len % (2 * n):
        raise ValueError(f"sequence length {model.config.seq_len} does not divide into 2 x {n} chunks")
    if mode not in MODES:
        raise ValueError(f"unknown context-parallel mode {mode!r}; choose from {sorted(MODES)}")
    for block in model.blocks:
        if hasattr(block, "attn"):
            block.attn.core = ContextParallelCore(group, mode)
    return model


# ---------------------------------------------------------------------------
# The block kernels: PyTorch's fused attention, and which one a block gets
# ---------------------------------------------------------------------------
#
# PyTorch's fused attention kernels, each with its backward: private operators, called by position as
# their schemas read in PyTorch 2.13 (`default_kernels` falls back to the reference where they are
# missing). Each takes q, k, v in their own dtype (float16/bfloat16 stay so: inside, the kernels keep
# the softmax in float32, as FlashAttention does) and returns a float32 log-sum-exp (float64 for
# float64 inputs on CPUs), each laid out its own way, while the merge takes (batch, heads, queries):
#   CPU flash       (batch, queries, heads) viewed as (batch, heads, queries); its backward takes any strides
#   CUDA flash      (batch, heads, queries), contiguous, as its backward reads it
#   CUDA efficient  (batch, heads, ceil(queries / 32) * 32): rows padded to the kernel's 32-query tiles
#                   (not padded on ROCm), and its backward reads rows padded alike
# as the operators' shape rules in torch/_meta_registrations.py lay them out. `_lse_for_merge` and
# `_lse_for_backward` are the one place that converts. (The memory-efficient backward also assumes its
# output laid out as its forward writes it, (batch, queries, heads, head_dim) in memory: its row
# stride is computed, not read off the tensor; see `_efficient_layout`.)
#
# A block's mask (`attention_masks`): True or False is the kernels' is_causal. A boolean tensor (within
# documents) is passed as an additive float mask, 0 where a query sees a key and -inf elsewhere, in the
# inputs' dtype (`_causal_and_bias`): the CPU kernel refuses a boolean attn_mask ("Attention mask is the
# same data type as query", PyTorch 2.13) and takes the additive one, equal to the reference in float64
# (tests/test_cp.py); the memory-efficient kernel's attn_bias is additive by definition, (batch, heads,
# queries, keys) with aligned rows (`_efficient_bias`). FlashAttention on CUDA takes no mask, so
# CUDA_FLASH hands masked blocks to the memory-efficient kernel, fused too and taking the same dtypes (the
# written-out reference would hold a block's scores in float32). A row of a block that sees no key gets
# output 0 and the lowest finite log-sum-exp whatever the kernel (VisibleMasks.kernels_for; the CPU kernel
# returns a log-sum-exp of 0 there).
_EFFICIENT_LSE_TILE = 1 if torch.version.hip else 32


def _lse_for_merge(lse, n_queries):
    """A kernel's log-sum-exp as the merge takes it: (batch, heads, queries), any padding cut off."""
    return lse[..., :n_queries]


def _lse_for_backward(lse, tile=1):
    """The merged (batch, heads, queries) log-sum-exp as a CUDA kernel's backward reads it: contiguous,
    rows padded with zeros to a multiple of `tile`, as its forward pads them."""
    return F.pad(lse, (0, -lse.shape[-1] % tile)).contiguous()


def _efficient_layout(out):
    """out (batch, heads, queries, head_dim) stored as the memory-efficient forward stores its output,
    queries outermost after the batch (aten's _efficient_attention_backward takes the output's batch and
    head strides from the tensor but assumes heads x head_dim between queries)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


_CPU_FLASH = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
_CUDA_FLASH = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
_CUDA_EFFICIENT = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")


def _causal_and_bias(mask, dtype):
    """A block's mask as the fused kernels take it: (is_causal, None) for plain causal blocks (True or False);
    for a boolean mask (within documents), (False, an additive float mask in `dtype`: 0 where a query sees a
    key, -inf elsewhere)."""
    if not isinstance(mask, torch.Tensor):
        return mask, None
    return False, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _efficient_bias(mask, q, k):
    """_causal_and_bias for the memory-efficient kernel, whose attn_bias must be (batch, heads, queries, keys)
    (here expanded: strides 0, no copies) with rows aligned in memory: padded to 16 elements, as SDPA's
    preprocess_mask pads them."""
    causal, bias = _causal_and_bias(mask, q.dtype)
    if bias is None:
        return causal, None
    keys = bias.shape[-1]
    bias = F.pad(bias, (0, -keys % 16))[..., :keys]
    return causal, bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def cpu_flash_block(q, k, v, mask):
    """block_attention by PyTorch's fused CPU kernel (flash attention): the scores never exist whole."""
    causal, bias = _causal_and_bias(mask, q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)


def cpu_flash_block_backward(grad_out, q, k, v, out, lse, mask):
    """block_attention_backward by the CPU kernel's backward, given the merged output and log-sum-exp."""
    causal, bias = _causal_and_bias(mask, q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0,
                                                                               causal, attn_mask=bias)


def cpu_flash_block_in_float32(q, k, v, mask):
    """cpu_flash_block on q, k, v widened to float32: in half precision the CPU kernel's backward is many
    times slower than in float32 (20x measured at head size 32, PyTorch 2.13), and a CPU gains nothing
    from computing the block narrower. (What travels round the ring stays in the inputs' dtype.)"""
    return cpu_flash_block(*(_widened(t) for t in (q, k, v)), mask)


def cpu_flash_block_backward_in_float32(grad_out, q, k, v, out, lse, mask):
    """cpu_flash_block_backward on its tensors widened to float32 (its gradients come back in float32,
    which the ring sums in anyway)."""
    return cpu_flash_block_backward(*(_widened(t) for t in (grad_out, q, k, v, out)), lse, mask)


def cuda_flash_block(q, k, v, mask):
    """block_attention by FlashAttention-2 on CUDA (float16 and bfloat16 only). It takes no mask: a block
    within documents goes to the memory-efficient kernel (fused as well, and it takes the same dtypes)."""
    if isinstance(mask, torch.Tensor):
        return cuda_efficient_block(q, k, v, mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, mask)[:2]
    return out, _lse_for_merge(lse, q.shape[2])


def cuda_flash_block_backward(grad_out, q, k, v, out, lse, mask):
    """block_attention_backward by FlashAttention-2's backward (by the memory-efficient kernel's for a block
    within documents, as its forward). No cumulative sequence lengths (the batch is dense); the
    random-number state is read only under dropout, which is 0."""
    if isinstance(mask, torch.Tensor):
        return cuda_efficient_block_backward(grad_out, q, k, v, out, lse, mask)
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        grad_out, q, k, v, out, _lse_for_backward(lse), None, None, q.shape[2], k.shape[2], 0.0, mask,
        unused, unused)


def cuda_efficient_block(q, k, v, mask):
    """block_attention by the memory-efficient kernel on CUDA (xFormers' CUTLASS kernel: float32 too)."""
    causal, bias = _efficient_bias(mask, q, k)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention.default(q, k, v, bias, True, 0.0, causal)[:2]
    return out, _lse_for_merge(lse, q.shape[2])


def cuda_efficient_block_backward(grad_out, q, k, v, out, lse, mask):
    """block_attention_backward by the memory-efficient kernel's backward (dQ, dK, dV; no bias gradient).
    Its random-number seed and offset are read only under dropout, which is 0."""
    causal, bias = _efficient_bias(mask, q, k)
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
        grad_out, q, k, v, bias, _efficient_layout(out), _lse_for_backward(lse, _EFFICIENT_LSE_TILE),
        unused, unused, 0.0, [True, True, True, False], causal)[:3]


# How each block is computed: written out (EXPLICIT, before the banner: the readable reference the
# self-check compares against), or fused (memory linear in the sequence: the (s/2N)² scores of a block are
# never materialised).
FUSED = (cpu_flash_block, cpu_flash_block_backward)  # on CPUs
FUSED_IN_FLOAT32 = (cpu_flash_block_in_float32, cpu_flash_block_backward_in_float32)  # on CPUs, half precision
CUDA_FLASH = (cuda_flash_block, cuda_flash_block_backward)
CUDA_EFFICIENT = (cuda_efficient_block, cuda_efficient_block_backward)


def _have(ops):
    """Whether this PyTorch has these private operators (a PyTorch without them gets the reference)."""
    return all(hasattr(torch.ops.aten, op) for op in ops)


@functools.lru_cache  # chosen once per (device, dtype, head size), not at every layer's call: it asks the GPU
def default_kernels(device, dtype, head_dim, v_head_dim=None):
    """The fused kernels where PyTorch has them for blocks of this dtype and head size, else the reference.

    CPU: its flash kernel, computing half-precision blocks in float32. CUDA: flash attention for
    float16/bfloat16 (Ampere or later, heads up to 256), the memory-efficient kernel for float32 and the
    half-precision blocks flash cannot take; float64 (no fused CUDA kernel has it), head sizes not a
    multiple of 8 (the CUDA kernels' alignment: SDPA pads them, this file does not) and other devices: the
    written-out blocks. Values of another width than the queries' and keys' (v_head_dim: DeepSeek's latent
    attention, 128 against 192): only the memory-efficient kernel takes them (flash, on either device, wants
    one head size), else the written-out blocks.
    """
    if v_head_dim not in (None, head_dim):
        fits = device.type == "cuda" and dtype != torch.float64 and not (head_dim % 8 or v_head_dim % 8)
        return CUDA_EFFICIENT if fits and _have(_CUDA_EFFICIENT) and (
            dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) >= (8, 0)) else EXPLICIT
    if device.type == "cpu":
        if not _have(_CPU_FLASH):
            return EXPLICIT
        return FUSED if dtype in (torch.float32, torch.float64) else FUSED_IN_FLOAT32
    if device.type != "cuda" or dtype == torch.float64 or head_dim % 8:
        return EXPLICIT
    ampere = torch.cuda.get_device_capability(device) >= (8, 0)
    if (dtype in (torch.float16, torch.bfloat16) and ampere and head_dim <= 256 and _have(_CUDA_FLASH)
            and torch.backends.cuda.is_flash_attention_available()):
        return CUDA_FLASH
    if (dtype == torch.bfloat16 and not ampere) or not _have(_CUDA_EFFICIENT):  # no bfloat16 kernel before Ampere
        return EXPLICIT
    return CUDA_EFFICIENT


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node 4 cp.py
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


def _self_check_documents(seq_len, device):
    """(2, seq_len) document ids: one token each in one row (boundaries inside chunks); in the other, two
    chunks each (the self-check's chunks are 2 tokens), so that a rank needs one or two other ranks' blocks
    and the ring skips the others' blocks and messages."""
    return torch.stack([torch.arange(seq_len), torch.arange(seq_len) // 4]).to(device)


def _full_attention(q, k, v, documents=None, window=None, sinks=None):
    """The whole sequence's attention written out: query i sees key j if j <= i, in its document if
    documents are given, within the window if given; each head's sink, if given, in the denominator."""
    at = torch.arange(q.shape[2], device=q.device)
    seen = (at[None, :] <= at[:, None]) & (at[:, None] - at[None, :] < (window or q.shape[2]))
    if documents is not None:
        seen = seen & (documents[:, :, None] == documents[:, None, :])
    k, v = (repeat_kv(t, q.shape[1] // k.shape[1]) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~seen.unsqueeze(-3), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :k.shape[2]] @ v


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


def _check_against_full_attention(attention, n_heads, n_kv_heads, rank, n, device, kernels, documents=None,
                                  window=None, with_sinks=False):
    """The largest difference of `attention` (ring_attention, ...) from full causal attention (output, dQ, dK,
    dV, and the sinks' gradient) on this rank, within documents, a window and with sinks if given: the whole
    sequence's attention written out (`_full_attention`)."""
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(2, n_heads, 4 * n, 8, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    k, v = (torch.randn(2, n_kv_heads, 4 * n, 8, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    sinks = torch.randn(n_heads, generator=g, dtype=torch.float64).to(device) if with_sinks else None
    full, full_sinks = [t.clone().requires_grad_() for t in (q, k, v)], _leaf(sinks)
    expected = _full_attention(*full, documents, window, full_sinks)
    expected.backward(grad)
    local, local_sinks = [shard_sequence(t, n, rank, dim=2).requires_grad_() for t in (q, k, v)], _leaf(sinks)
    out, _ = attention(*local, None, kernels=kernels, documents=documents, window=window, sinks=local_sinks)
    out.backward(shard_sequence(grad, n, rank, dim=2))
    worst = (out - shard_sequence(expected, n, rank, dim=2)).abs().max().item()
    for mine, reference in zip(local, full):
        worst = max(worst, (mine.grad - shard_sequence(reference.grad, n, rank, dim=2)).abs().max().item())
    if with_sinks:  # each rank's share of the sinks' gradient (its queries'; its heads' under the all-to-all)
        dist.all_reduce(local_sinks.grad)
        worst = max(worst, (local_sinks.grad - full_sinks.grad).abs().max().item())
    worst_all = torch.tensor([worst], device=device)
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    return worst_all.item()


def _self_check():
    device = _join_process_group()
    backend, rank, n = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    worst = 0.0
    # In float64: the fused CPU kernel and the reference; on CUDA the reference only (no fused CUDA kernel
    # takes float64; tests/test_cuda.py checks those against the reference in bfloat16 and float32).
    kernel_sets = [("fused", FUSED), ("explicit", EXPLICIT)] if device.type == "cpu" else [("explicit", EXPLICIT)]
    # Plain causal attention, then within packed documents (the ring skipping blocks and messages), then
    # also within a window of 3 tokens and with sinks.
    documents = _self_check_documents(4 * n, device)
    cases = [((None, None, False), ""), ((documents, None, False), " within packed documents"),
             ((documents, 3, True), " within packed documents, a window of 3 and sinks")]
    for seen, within in cases:
        for (name, kernels), n_kv_heads in [(k, h) for k in kernel_sets for h in (4, 1)]:  # multi-head and GQA
            comm_bytes.clear(), blocks_computed.clear()
            difference = _check_against_full_attention(ring_attention, 4, n_kv_heads, rank, n, device, kernels,
                                                       *seen)
            worst = max(worst, difference)
            if rank == 0:
                print(f"cp.py self-check on {n} ranks ({backend}), {name} blocks, 4 query heads, {n_kv_heads} "
                      f"key/value heads: largest difference from full causal attention{within} (output, dQ, dK, dV, "
                      f"float64) = {difference:.3g}; bytes sent by rank 0 {comm_bytes['send_recv']}; blocks on "
                      f"rank 0: {blocks_computed['forward']} forward, {blocks_computed['backward']} backward",
                      flush=True)
        # The other two ways, by the first kernels: the all-gather with grouped-query attention, the all-to-all
        # with two heads a rank (any N).
        for mode, heads, kv_heads in [("allgather", 4, 1), ("alltoall", 2 * n, 2 * n)]:
            comm_bytes.clear()
            difference = _check_against_full_attention(MODES[mode], heads, kv_heads, rank, n, device,
                                                       kernel_sets[0][1], *seen)
            worst = max(worst, difference)
            if rank == 0:
                print(f"cp.py self-check on {n} ranks ({backend}), {mode}: largest difference from full causal "
                      f"attention{within} = {difference:.3g}; bytes sent per rank {dict(comm_bytes)}", flush=True)
    dist.destroy_process_group()
    if worst > 1e-12:
        raise SystemExit(f"rank {rank}: ring attention differs from full attention")


if __name__ == "__main__":
    _self_check()
