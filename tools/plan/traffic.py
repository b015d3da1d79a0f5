"""Traffic of the model-parallel dimensions (tp, cp, the MoE layers' groups, pp), per micro-batch, forward and
backward."""
import functools
from collections import Counter

import cp
from dp import ring_bytes_sent
from ep import is_expert_parameter
from model import PLACEMENTS
from training.count.parameters import config_key, model_parameters, norms_per_block
from tools.plan.attention import attention_of


def tokens_per_rank(config, layout):
    """Tokens of one micro-batch a rank computes on (its data slice, its cp shard of each sequence)."""
    return layout.micro_batch * config.seq_len // layout.cp


def routed_tokens(config, layout):
    """Tokens of one micro-batch a rank routes in an MoE layer (ep.py): no other rank routes them. Under tp
    with sp its sequence shard; under tp without sp its 1/tp of the tokens the tp ranks share (ep.py's
    split_counts: the first ranks one more when tp does not divide them; the planner assumes it does)."""
    return tokens_per_rank(config, layout) // layout.tp


def tp_traffic(config, layout, layers, first, last):
    """Tensor parallelism's bytes per micro-batch (Megatron: two all-reduces of b*s*h per block forward,
    two backward; sequence parallelism turns each into a reduce-scatter and an all-gather)."""
    t, c, traffic = layout.tp, config, Counter()
    if t == 1:
        return traffic
    hidden = tokens_per_rank(c, layout) * c.d_model  # b*s*h of this rank's cp shard (gathered under sp)
    # What enters a region is a norm's output, what leaves it a matrix product's partial sum, both in the
    # weights' dtype; backward sends the gradients of the same tensors, in the same dtype.
    enter = leave = hidden * layout.weight_bytes
    # A recomputed block (full recomputation) communicates again, but only up to the last tensor its backward
    # needs: non-reentrant checkpointing stops there, so the collective that closes the MLP is not repeated.
    again = 2 if layout.recompute == "full" else 1

    def region(enter, leave, entering, leaving):
        """f then g (all-reduce backward, all-reduce forward), or under sp all-gather then reduce-scatter;
        entering and leaving: how many times the forward's collective runs."""
        if layout.sp:
            send("all_gather", enter, entering)
            send("reduce_scatter", leave, leaving)
            send("all_gather", leave, 1)
            send("reduce_scatter", enter, 1)
        else:
            send("all_reduce", leave, leaving)
            send("all_reduce", enter, 1)

    def send(kind, n_bytes, times):
        traffic[kind] += times * ring_bytes_sent(kind, n_bytes, t)

    def summed_gradients(numel):  # under sp, norms and row biases sum their gradients over the group
        send("all_reduce", numel * layout.weight_bytes, 1)

    norm_numel = c.d_model * (2 if c.norm == "layer" and c.bias else 1)
    if first:  # the vocabulary-parallel embedding's g (its output keeps the weights' dtype)
        if layout.sp:  # reduce-scatter forward, all-gather backward
            send("reduce_scatter", enter, 1)
            send("all_gather", enter, 1)
        else:
            send("all_reduce", enter, 1)
        if layout.sp and c.position == "learned":
            summed_gradients(c.max_seq_len * c.d_model)  # the whole position table's
    entering_attention = tokens_per_rank(c, layout) * attention_of(c).entering(c) * layout.weight_bytes
    for layer in layers:
        region(entering_attention, leave, again, again)  # attention
        mlp = not c.is_moe(layer) or c.n_shared_experts  # a dense MLP, or the shared expert, split alike
        if mlp:  # recomputed up to the last tensor backward needs: the output a norm after the MLP keeps, or
            # with a gate, the output its product keeps
            kept_after = PLACEMENTS[c.norm_placement][1] or (c.is_moe(layer) and c.shared_expert_gate)
            region(enter, leave, again, again if kept_after else 1)
        if c.is_moe(layer):  # tp.split_moe: every tp rank routed tokens of its own, so the router's gradient is summed
            send("all_reduce", c.n_experts * c.d_model * layout.weight_bytes, 1)
            if c.router_bias:  # (gpt-oss's: a gradient of its own)
                send("all_reduce", c.n_experts * layout.weight_bytes, 1)
        for numel in attention_of(c).summed_over_tp(c, layout):  # replicated weights that met only some tokens
            summed_gradients(numel)
        if c.qk_norm and c.qk_norm_scope == "projection":  # its squares of q's and k's, forward and backward
            squares = tokens_per_rank(c, layout) * max(layout.activation_bytes, 4)
            send("all_reduce", squares, 2 * again + 2)
        if layout.sp:  # the norms, the row-parallel biases of attention and the MLP, a shared expert's gate
            gate = c.is_moe(layer) and c.shared_expert_gate
            summed_gradients(norms_per_block(c) * norm_numel + c.bias * c.d_model * (2 if mlp else 1)
                             + gate * c.d_model)
    if last:
        if layout.sp:
            summed_gradients(norm_numel)
            send("all_gather", enter, 1)
            send("reduce_scatter", enter, 1)
        else:
            send("all_reduce", enter, 1)  # the head's f
        loss_bytes = tokens_per_rank(c, layout) * max(layout.activation_bytes, 4)  # float32 or wider
        send("all_reduce", loss_bytes, 1)      # the largest logit
        send("all_reduce", 2 * loss_bytes, 1)  # the target's logit and the sum of exponentials
    return traffic


def ring_differs_by_rank(config, layout):
    """Whether the ring's traffic differs from cp rank to cp rank: under a sliding window (cp_traffic)."""
    return layout.cp > 1 and layout.cp_mode == "ring" and bool(config.sliding_window)


def cp_traffic(config, layout, layers, cp_rank=0):
    """Context parallelism's bytes per micro-batch (cp.py, each way's formula), with k, v and q the bytes of this
    rank's K, V and Q shards (V of its own width, c.v_dim: latent attention's values are narrower than its keys)
    and o of the heads' output (n_head x v_head_dim features):
      ring       K and V go round the ring (N-1 passes) in forward and again in backward, where their
                 gradient accumulators also travel N passes (each block home)
      allgather  K and V all-gathered in forward and again in backward, dK and dV reduce-scattered:
                 (N-1) (k + v) each
      alltoall   q, k, v to head shards and the output back, forward, and their gradients in backward:
                 (N-1)/N of each
    Recomputation runs the forward's part again. Under a sliding window the ring's K/V blocks and their
    gradients go only as far as a query sees, which differs from rank to rank (cp_rank's: `ring_messages`).
    With packed documents the ring's figure is its most: a K/V block that no rank ahead needs in any row of
    the micro-batch goes no further, which depends on the data (cp.py's tests count the bytes saved exactly)."""
    n = layout.cp
    if n == 1:
        return Counter()
    c, a = config, layout.activation_bytes
    q, k, v, o = (tokens_per_rank(c, layout) * features // layout.tp * a
                  for features in (c.q_dim, c.kv_dim, c.v_dim, c.n_head * c.v_head_dim))
    forward_passes = 1 if layout.recompute == "none" else 2  # both modes run the attention again
    if layout.cp_mode == "allgather":
        return Counter(all_gather=len(layers) * (forward_passes + 1) * (n - 1) * (k + v),
                       reduce_scatter=len(layers) * (n - 1) * (k + v))
    if layout.cp_mode == "alltoall":
        # Selective recomputation reruns the core only up to what it saves (the attention's inputs and output,
        # on head shards): checkpoint's recomputation stops there, before the output goes back.
        recomputed = {"none": 0, "selective": q + k + v, "full": q + k + v + o}[layout.recompute]
        return Counter(all_to_all=len(layers) * (n - 1) * (2 * (q + k + v + o) + recomputed) // n)
    chunk = c.seq_len // (2 * n)
    windows = Counter(c.window(layer) for layer in layers)  # {window or None: layers}
    kv_passes, gradient_messages = (sum(counts) for counts in zip(*(
        [count * m for m in ring_messages(n, cp_rank, window, chunk)] for window, count in windows.items())))
    forward = kv_passes * (k + v)
    backward = forward + gradient_messages * (k + v)  # dK, dV travel in K's and V's dtype
    return Counter(send_recv=forward_passes * forward + backward)


@functools.lru_cache(maxsize=None)
def ring_messages(n, rank, window, chunk):
    """(K/V passes, dK/dV messages) of one ring attention call on ring rank `rank`, from cp.py's own plan:
    N-1 and N under plain causal attention, where every block goes round the whole ring and its accumulators
    home; with a window, a block goes only as far as some query sees it, and its accumulators come home from
    there (a rank holding a block at a step sends accumulators on if it added to them or relays them)."""
    plan = cp.attention_masks(None, window).ring_plan(rank, n, chunk)
    kv_passes = sum(plan.passes_on(step) for step in range(n))
    holds = [bool(plan.blocks(step)) or (step > 0 and plan.receives(step - 1)) for step in range(n)]
    return kv_passes, sum(held and plan.gradients_to(step) is not None for step, held in enumerate(holds))


def moe_traffic(config, layout, layers):
    """The MoE layers' traffic per micro-batch (ep.py, balanced routing), by the group it travels in:
      ep              dispatch and combine: the routed tokens' assignments to experts of the other ep ranks,
                      (ep-1)/ep of them, go out and their outputs come back; backward the reverse
      tp_rows         tp without sp: each tp rank routes its 1/tp of the tokens they share (KeepRows: its
                      part's gradient to every other tp rank, backward) and all-gathers the outputs
                      (GatherRows, forward)
      expert_tp       expert tp: the rows a rank received go to every other rank of its group, and its
                      experts' partial outputs of their rows go back to them (SplitExperts); backward the
                      reverse of each
      expert_tp_bias  expert tp: each local expert's proj bias, whole on every rank, has its gradient summed
                      over the group once per backward of each run of the expert (tp.ExpertTensorParallel; the
                      GPT blocks' bias): with --ep-overlap once a chunk
    All but the last are ep.py's all-to-alls, each row in the weights' dtype, which is the activations'.
    Full recomputation runs the forward's again up to the last tensor backward needs: the combined outputs
    (weighted), so GatherRows too only when a shared expert, whose tensors come after, or a norm after the
    layer, which keeps its output, is there."""
    c = config
    moe_layers = sum(1 for layer in layers if c.is_moe(layer))
    if not moe_layers:
        return {}
    forwards = 2 if layout.recompute == "full" else 1
    row = c.d_model * layout.activation_bytes
    routed = routed_tokens(c, layout)
    assignments = routed * c.top_k  # balanced: each rank also receives as many for its experts

    def rows(n_rows, passes):  # all-to-all bytes of every MoE layer, n_rows sent per pass
        return Counter(all_to_all=moe_layers * passes * n_rows * row)

    traffic = {"ep": rows(assignments * (layout.ep - 1) // layout.ep, 2 * (forwards + 1))}
    if layout.tp > 1 and not layout.sp:
        gathers = forwards if c.n_shared_experts or PLACEMENTS[c.norm_placement][1] else 1
        traffic["tp_rows"] = rows((layout.tp - 1) * routed, gathers + 1)
    if layout.expert_tp > 1:
        traffic["expert_tp"] = rows((layout.expert_tp - 1) * assignments, 2 * (forwards + 1))
        if c.bias:
            bias = ring_bytes_sent("all_reduce", c.d_model * layout.weight_bytes, layout.expert_tp)
            runs = max(layout.ep_overlap, 1)
            traffic["expert_tp_bias"] = Counter(all_reduce=moe_layers * c.n_experts // layout.ep * bias * runs)
    return traffic


def fp8_traffic(config, layout, layers):
    """The float8 scales' maxima reduced over the groups splitting a linear layer (training/fp8.py), float32,
    per micro-batch, {"fp8": over tp, "fp8_expert_tp": over expert tp}. A layer's rows are the rank's tokens, an
    expert's those it received over its expert-tp group (taken as balanced); a rank holds n_experts / ep of a
    layer's experts, all shaped alike."""
    traffic = {"fp8": Counter(), "fp8_expert_tp": Counter()}
    if not layout.fp8:
        return traffic
    held = config.n_experts // layout.ep
    for name, (out, features) in fp8_weights(config, layers):
        expert = is_expert_parameter(name)
        group = layout.expert_tp if expert else layout.tp
        if group == 1 or expert and int(name.split(".experts.")[1].split(".")[0]) >= held:
            continue
        rows = (layout.expert_tp * layout.ep * routed_tokens(config, layout) * config.top_k // config.n_experts
                if expert else tokens_per_rank(config, layout))
        for numel, times in maxima_reduced(layout, name.endswith("proj.weight"), rows, out, features):
            traffic["fp8_expert_tp" if expert else "fp8"]["all_reduce"] += \
                times * ring_bytes_sent("all_reduce", 4 * numel, group)
    return traffic


def maxima_reduced(layout, row_parallel, rows, out, features):
    """[(maxima, times)]: the all-reduces of a split layer per micro-batch (training/fp8.py's Split). A
    row-parallel layer's in forward (run again under full recomputation): rowwise, the input's per-token and
    the weight's per-output-feature maxima; tensorwise, the input's and the weight's, and both again in
    backward (dW's input, dX's weight). A column-parallel layer's in backward: rowwise, the output gradient's
    per-token and the weight's per-input-feature maxima; tensorwise, the weight's in forward and the output
    gradient's and the weight's in backward."""
    forwards = 2 if layout.recompute == "full" else 1
    if layout.fp8 == "rowwise":
        return [(rows, forwards), (out, forwards)] if row_parallel else [(rows, 1), (features, 1)]
    return [(1, 2 * forwards + 2)] if row_parallel else [(1, forwards + 2)]


def fp8_weights(config, layers):
    """[(name, (out, in))] of the linear layers of `layers` that compute in float8 (training/fp8.py's choice:
    every block matrix but the routers, shared experts' gates and latent attention's replicated down-projections
    (which no layout splits, so they reduce nothing))."""
    prefixes = tuple(f"blocks.{layer}." for layer in layers)
    return [(name, shape) for name, shape in model_parameters(config_key(config))
            if name.startswith(prefixes) and len(shape) == 2
            and not any(part in name for part in ("router", "shared_gate", "q_down", "kv_down"))]


def pp_traffic(config, layout, stage):
    """Point-to-point bytes per step: an activation forward and a gradient backward per micro-batch and
    chunk boundary (the article's b*s*h; a sequence-parallel shard under sp), in the weights' dtype."""
    if layout.pp == 1:
        return Counter()
    seq = config.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    message = layout.micro_batch * seq * config.d_model * layout.weight_bytes
    placement = layout.placement
    sent = [placement.holder(k + 1)[0] for k in placement.model_chunks(stage) if k < placement.n_model_chunks - 1]
    sent += [placement.holder(k - 1)[0] for k in placement.model_chunks(stage) if k > 0]
    boundaries = sum(destination != stage for destination in sent)  # (the turn of a V stays on its rank)
    return Counter(send_recv=layout.micro_batches * boundaries * message)
