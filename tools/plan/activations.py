"""Activations saved for backward (what meter.ActivationMeter counts), per micro-batch: each block's, the edges',
and their peak over the micro-batches a pipeline schedule keeps in flight."""
from collections import Counter

import pp
from tools.plan.attention import attention_of
from training.count.parameters import norms_per_block
from tools.plan.traffic import routed_tokens, tokens_per_rank


INT64, BOOL = 8, 1  # bytes of the index and mask tensors some operators save


def block_activations(c, layout, layer):
    """Bytes one block saves for backward in one micro-batch's forward, term by term (Korthikanti et al.,
    2022, section 4, count Megatron's block the same way: b*s*h units, sharded by t where tp splits them).
    Under selective recomputation, what it keeps: its attention core's own tensors go (recomputed_block)."""
    t, a = layout.tp, layout.activation_bytes
    tokens = tokens_per_rank(c, layout)
    sharded = tokens // t if layout.sp else tokens  # the residual stream: a sequence shard under sp
    norm = sharded * norm_activations(c, layout)
    attention = attention_of(c).activations(c, layout, tokens).kept
    if c.is_moe(layer):
        mlp = moe_activations(c, layout, tokens)
    else:  # fc's input, and the MLP's own
        mlp = tokens * c.d_model * a + mlp_activations(c, tokens, t, a)
    return norms_per_block(c) * norm + attention + mlp



def norm_activations(c, layout):
    """What a norm keeps per token: LayerNorm's kernel its input and statistics (mean, 1/std) in the input's
    dtype; RMSNorm (PyTorch's composite on CPUs) and Gemma's OffsetRMSNorm its input and x/rms in float32 or
    wider (an input narrower than float32 is cast up first), and 1/rms."""
    if c.norm == "layer":
        return c.d_model * layout.weight_bytes + 2 * layout.weight_bytes
    wide = max(layout.weight_bytes, 4)
    return 2 * c.d_model * wide + wide


# What an MLP's activation keeps per hidden unit, fc's output included, in elements: GELU its input and output;
# SwiGLU gate | up, silu(gate) and their product; gpt-oss's clamped SwiGLU gate | up, the clamped gate, its
# sigmoid, gate times that, up + 1, and the product; GeGLU SwiGLU's, gelu(gate) in place of silu(gate).
KEPT_BY_ACTIVATION = {"gelu": 2, "gelu_tanh": 2, "swiglu": 4, "clamped_swiglu": 7, "geglu": 4}


def mlp_activations(c, rows, t, a, d_ff=None):
    """fc's output and what the activation keeps (KEPT_BY_ACTIVATION)."""
    return rows * (d_ff or c.d_ff) // t * a * KEPT_BY_ACTIVATION[c.mlp]


def moe_activations(c, layout, tokens):
    """An MoE layer as ep.py computes it, balanced, on a rank holding `tokens` of the micro-batch (moe_parts)."""
    return sum(moe_parts(c, layout, tokens))


def moe_parts(c, layout, tokens):
    """(kept before its tokens are dispatched, by its experts, after their outputs are combined) of an MoE layer
    as ep.py computes it, balanced, on a rank holding `tokens` of the micro-batch:
    - the router: its input, the arriving tokens (tp without sp keeps its part of them as a view, so their
      whole storage), and per routed token (routed_tokens) the scores (SCORES_KEPT) and choices, and where the
      gates are renormalised (norm_topk_prob) the top-k probabilities and their sum that divides them;
    - per (token, expert) assignment it sends: before, the indices that sort and return it and the mask that
      kept it; after, its gate, the output that came back and its weighted copy;
    - per row its experts compute (under expert tp the rows of every rank of the group, each having received
      as many): the expert's input and its MLP, of hidden width d_expert / expert_tp;
    - the shared expert's MLP on every arriving token, split by tp (under sp on the gathered sequence, its
      input a tensor of its own), of hidden width d_shared; with a gate (Qwen2-MoE), the sigmoid and the
      shared expert's output it multiplies, per arriving token (after: ep.py runs it once the routed tokens
      are back)."""
    t, a, wide, h = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4), c.d_model
    arriving = tokens // t if layout.sp else tokens
    routed = routed_tokens(c, layout)
    assignments = routed * c.top_k
    rows = assignments * layout.expert_tp
    renormalised = c.norm_topk_prob * (c.top_k + 1)
    router = (arriving * h * a + routed * ((SCORES_KEPT[c.router_scoring](c) + renormalised) * wide
                                           + c.top_k * INT64) + balance_statistics(c, layout))
    # (the gates are cast to the tokens' dtype)
    sorting, returned = assignments * (2 * INT64 + BOOL), assignments * (2 * h * a + a)
    experts = rows * h * a + mlp_activations(c, rows, layout.expert_tp, a, c.d_expert)
    shared = 0
    if c.n_shared_experts:
        gathered = tokens * h * a if layout.sp else 0
        gate = c.shared_expert_gate * arriving * (1 + h) * a
        shared = gathered + mlp_activations(c, tokens, t, a, c.d_shared) + gate
    return router + sorting, experts, returned + shared


# What the router's scores keep per routed token (ep.py's SCORES), in elements: the softmax its output; DeepSeek-V3's
# sigmoid its output, and the division that makes them the probabilities (scores / their sum) the sum.
SCORES_KEPT = {"softmax": lambda c: c.n_experts, "sigmoid": lambda c: c.n_experts + 1}


def balance_statistics(c, layout):
    """What the load-balancing loss keeps (ep.py), per unit it balances (the micro-batch, or each of its
    sequences): each expert's fraction f_i and the unit's token count. Per sequence also what summing each
    sequence's probabilities keeps (an index_add): each routed token's sequence, and the probabilities, which
    a softmax's output already holds but DeepSeek-V3's sigmoid scores divide into a tensor of their own."""
    wide = max(layout.activation_bytes, 4)
    per_unit = (c.n_experts + 1) * wide
    if c.aux_loss_scope != "sequence":  # (global balance's f: the previous step's, kept as the unit's would be)
        return per_unit
    probs = c.n_experts * wide if c.router_scoring == "sigmoid" else 0
    return layout.micro_batch * per_unit + routed_tokens(c, layout) * (INT64 + probs)


def recomputed_block(c, layout, layer):
    """(what a block keeps from forward until its backward, what its backward's recomputation holds)."""
    full = block_activations(c, layout, layer)
    tokens = tokens_per_rank(c, layout)
    if layout.recompute == "full":  # only the block's input, the residual stream
        kept = (tokens // layout.tp if layout.sp else tokens) * c.d_model * layout.weight_bytes
        return kept, full
    if layout.recompute == "selective":  # (full: what it keeps without its core's own, which it holds again)
        return full, attention_of(c).activations(c, layout, tokens).core
    return full, 0


def recomputed_positions(c, layout, first):
    """With packed documents, what a chunk's recomputed blocks keep besides the residual stream, once for all
    of them: under full recomputation the positions (each chunk computes its own), unless they are the ones
    the first chunk's learned table keeps already."""
    if not layout.documents or layout.recompute != "full" or (first and c.position == "learned"):
        return 0
    return tokens_per_rank(c, layout) * INT64


def recomputed_documents(c, layout):
    """With packed documents, what recomputed blocks keep of a micro-batch's document ids (of the whole
    sequence, for the core): one tensor, whichever of a rank's chunks keep it, until the last lets it go."""
    if not layout.documents or layout.recompute == "none":
        return 0
    return layout.micro_batch * c.seq_len * INT64


def edge_activations(c, layout, first, last):
    """(the embedding's token ids; the final norm and the head's input, the loss's softmax and targets)."""
    t, a, tokens = layout.tp, layout.activation_bytes, tokens_per_rank(c, layout)
    embedding = head = loss = 0
    if first:
        if t > 1:  # the vocabulary-parallel embedding's local ids and what lies outside its range
            embedding = tokens * (INT64 + BOOL)
        elif layout.cp > 1:  # the ids: a copy, this rank's zigzag shard (else a view, see shared_activations)
            embedding = tokens * INT64
        if c.position == "learned" and layout.documents:  # the micro-batch's own positions, which it looks up
            embedding += tokens * INT64
    if last:
        sharded = tokens // t if layout.sp else tokens
        norm = sharded * norm_activations(c, layout)
        head = norm + tokens * c.d_model * a
        softmax = tokens * c.padded_vocab_size // t * max(a, 4)
        # The cross-entropy keeps a flat copy of the targets (tp: local targets, and which are its own).
        targets = tokens * (INT64 + BOOL if t > 1 else INT64) if not batch_view_targets(layout) else 0
        mean = max(a, 4) if t == 1 else 0  # cross_entropy's mean keeps a scalar; tp's own mean does not
        # model.without_padding keeps the index of the padding it fills (tp's cross-entropy saves none of its own)
        padding = (c.padded_vocab_size - c.vocab_size) * INT64 if t == 1 else 0
        loss = softmax + targets + mean + padding
    return embedding + head, loss


def batch_view_targets(layout):
    """Whether the cross-entropy keeps the targets as a view into the step's batch of tokens rather than a
    flat copy: a single sequence's (1, s) slice flattens without copying (unless cp copied out a shard, or
    tp's cross-entropy keeps local targets instead)."""
    return layout.micro_batch == 1 and layout.cp == 1 and layout.tp == 1 and not layout.documents


def shared_activations(c, layout, stage):
    """What every micro-batch saves from the same storage, counted once: on the first stage the ids, a view
    into the step's whole batch of tokens (unless cp copied out a shard, or tp looks up local ids instead),
    on the last the targets if they are such a view too;
    the positions, if a learned table looks them up or full recomputation keeps them with each block's input
    (under sp a view of them all)."""
    first = stage == layout.placement.first_rank
    shared = step_batch(c, layout) if ids_view(layout, stage) else targets_view(c, layout, stage)
    if ((first and c.position == "learned") or layout.recompute == "full") and not layout.documents:
        shared += c.seq_len // layout.cp * INT64
    return shared


def chunk_activations(c, layout, model_chunk):
    """(kept until the weights' gradients, of which the losses': freed at B by ZB-H1, the most held by one
    recomputation) of one model chunk and micro-batch. The losses' share is the cross-entropy's and the
    load-balancing losses' statistics: it lies above every weight's branch."""
    n_model_chunks = layout.placement.n_model_chunks
    layers = pp.split_layers(c.n_layer, n_model_chunks)[model_chunk]
    blocks = [recomputed_block(c, layout, layer) for layer in layers]
    first, last = model_chunk == 0, model_chunk == n_model_chunks - 1
    edges, loss = edge_activations(c, layout, first, last)
    kept = sum(kept for kept, _ in blocks) + edges + loss + recomputed_positions(c, layout, first)
    if layout.recompute != "full":  # (a recomputed block keeps only its input)
        loss += sum(balance_statistics(c, layout) for layer in layers if c.is_moe(layer))
    return kept, loss, max(r for _, r in blocks)


def exchange_marks(c, layout, model_chunk):
    """What one micro-batch's chunk holds for backward each time one of its MoE layers starts an all-to-all:
    where a paired action's halves hand over (pp.py's combined 1F1B). Forward, each layer's dispatch once its
    norms, attention and router are kept, its combine once its experts' are too. Backward from the last layer
    down, the combine's gradient, then the dispatch's: backward frees what forward kept in reverse, so it
    holds at each exchange what forward held at the same one (the meter's counts agree). A fully recomputed
    block holds only its input until its backward ends, and its recomputation exchanges twice more first.
    Returns (forward's, backward's), each in the order it meets them."""
    layers = pp.split_layers(c.n_layer, layout.placement.n_model_chunks)[model_chunk]
    tokens, after_norms = tokens_per_rank(c, layout), int(c.norm_placement in ("post", "sandwich"))
    held = (edge_activations(c, layout, model_chunk == 0, False)[0] + recomputed_positions(c, layout, model_chunk == 0)
            + recomputed_documents(c, layout))
    forward, backward = [], []
    for layer in layers:
        kept, _ = recomputed_block(c, layout, layer)
        if c.is_moe(layer) and layout.recompute == "full":
            forward += [held + kept] * 2
            backward = [held + kept] * 4 + backward
        elif c.is_moe(layer):
            _, experts, after = moe_parts(c, layout, tokens)
            after += after_norms * (tokens // layout.tp if layout.sp else tokens) * norm_activations(c, layout)
            marks = [held + kept - experts - after, held + kept - after]
            forward, backward = forward + marks, marks[::-1] + backward
        held += kept
    return forward, backward


def paired_peak(held, backward_kept, forward_kept, marks, targets=0):
    """The most held while a paired action runs: its backward first, each half on to its next all-to-all in
    turn (exchange_marks) or its end, from `held` (the backward's micro-batch, kept_backward, among it).
    targets: what no one holds between the backward's loss and the forward's (targets_view) but is in held."""
    forward, backward = marks
    others, peak = held - backward_kept, held
    for turn in range(len(forward)):
        backward_holds = backward[turn] if turn < len(backward) else 0
        peak = max(peak, others - targets + backward_holds + forward[turn])
    return max(peak, others + forward_kept + (backward[len(forward)] if len(forward) < len(backward) else 0))


def step_batch(c, layout):
    """The step's whole batch of tokens (each sequence and its next token), which views may keep."""
    return layout.batch_size * (c.seq_len + 1) * INT64


def ids_view(layout, stage):
    """Whether the first stage's embedding keeps its ids as a view into the step's batch (unless cp copied out
    a shard, or tp looks up local ids instead)."""
    return stage == layout.placement.first_rank and layout.cp == 1 and layout.tp == 1


def targets_view(c, layout, stage):
    """The step's batch, if on a last stage only the micro-batches' targets keep it as a view (no ids view
    does): held from a micro-batch's loss to its backward's, counted once (shared_activations)."""
    last = stage == layout.placement.last_rank
    return step_batch(c, layout) if last and batch_view_targets(layout) and not ids_view(layout, stage) else 0


def activation_peak(c, layout, stage):
    """(peak, recomputation): the most bytes kept for backward at once, over the micro-batches in flight
    (pp.py's schedule; one at a time without pipelining) times their chunk's activations; and what one
    block's recomputation holds on top of that during backward (which the meter, counting what forwards
    keep, does not see). Under ZB-H1 a micro-batch is held until its W, but its B already frees what lies
    above every weight's branch: the loss's softmax and targets (every node of a block leads to a weight).
    A paired action (combined 1F1B) peaks between its halves' turns (paired_peak), not after its forward."""
    n_chunks = layout.virtual_stages
    sizes = {chunk: chunk_activations(c, layout, k) for chunk, k in enumerate(layout.placement.model_chunks(stage))}
    if not layout.scheduled:
        actions = [(kind, 0, m) for m in range(layout.micro_batches) for kind in ("forward", "backward")]
    else:
        actions = pp.make_schedule(layout.schedule, layout.micro_batches, layout.pp, stage, n_chunks)
    split = any(kind == "weight" for kind, _, _ in pp.every_half(actions))
    live = peak = shared_activations(c, layout, stage)
    documents, holders = recomputed_documents(c, layout), Counter()  # micro-batch: its chunks keeping its ids
    last_use = "weight" if split else "backward"
    marks, in_flight = {}, 0  # a model chunk's exchange_marks, once a paired action runs it; micro-batches held
    for action in actions:
        paired = isinstance(action, pp.Paired)
        if paired:  # its halves take turns: the peak between them (combined 1F1B)
            (_, forward, _), (_, backward, _) = action
            marks[forward] = marks.get(forward) or exchange_marks(c, layout, layout.placement.model_chunks(stage)[forward])
            alone = targets_view(c, layout, stage) if in_flight == 1 else 0  # (only the backward's held them)
            peak = max(peak, paired_peak(live, sizes[backward][0] + documents, sizes[forward][0] + documents,
                                         marks[forward], alone))
        for kind, chunk, m in pp.halves(action):
            in_flight += {"forward": 1, last_use: -1}.get(kind, 0)
            kept, loss, _ = sizes[chunk]
            live -= {"forward": -kept, "backward": loss if split else kept, "weight": kept - loss}[kind]
            if kind == "forward":  # the first of the rank's chunks to run this micro-batch keeps its ids
                holders[m] += 1
                live += documents if holders[m] == 1 else 0
            elif kind == last_use:  # and the last to be done with it lets them go
                holders[m] -= 1
                live -= documents if holders[m] == 0 else 0
        peak = peak if paired else max(peak, live)
    return peak, max(recomputed for _, _, recomputed in sizes.values())
