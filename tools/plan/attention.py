"""The attention layers as the planner reads them (attention_of): what model.py's grouped-query and latent
attention save for backward, which of their weights tp sums the gradients of, what enters tp's region."""
from typing import Callable, NamedTuple


class AttentionSaved(NamedTuple):
    """What an attention layer saves for backward in one micro-batch: `kept` until its backward (under
    selective recomputation without its core's own tensors), `core` those the core keeps of its own, which
    selective recomputation drops and holds again while the core is recomputed in backward."""
    kept: int
    core: int


class Attention(NamedTuple):
    """How the planner reads one of model.py's attention layers: its activations (c, layout, tokens) ->
    AttentionSaved, the elements of each weight tensor parallelism replicates and sums the gradient of over
    the group in every backward (c, layout -> [elements]), beyond the block's norms, and the features a token
    enters the tensor-parallel region with (c -> features)."""
    activations: Callable
    summed_over_tp: Callable
    entering: Callable


def attention_of(c):
    """model.py's attention of this config: LatentAttention (kv_lora_rank) or CausalSelfAttention."""
    return LATENT_ATTENTION if c.kv_lora_rank else GROUPED_ATTENTION


def grouped_attention_activations(c, layout, tokens):
    """CausalSelfAttention (grouped-query heads, q | k | v fused in qkv), under the layout's recomputation."""
    t, a = layout.tp, layout.activation_bytes
    h, q, wide = c.d_model, c.q_dim, max(a, 4)
    attention = (tokens * h * a                            # qkv's input (gathered under sp)
                 + tokens * (q + 2 * c.kv_dim) // t * a    # q | k | v, which the attention core keeps
                 + tokens * q // t * a                     # the core's output
                 + tokens * c.n_head // t * wide)          # and its log-sum-exp per head
    if c.position == "rope":  # rotated q and k, and the cos and sin tables of q's and k's rotations
        attention += 2 * position_rows(layout) * (c.seq_len // layout.cp) * c.head_dim * wide
        if rotated_kept(layout):
            attention += tokens * (q + c.kv_dim) // t * a
    if proj_copies_heads(c, layout):
        attention += tokens * q // t * a
    attention += head_norm_activations(c, layout, tokens)
    # The core's own: its log-sum-exp, and its output unless proj reads it in place. No mask: within documents
    # and windows, cp.py's cores (one device's too) make each tile's mask again in backward from the ids.
    core = tokens * c.n_head // t * wide
    if proj_copies_heads(c, layout):  # proj keeps its own copy of the output, so the core's goes too
        core += tokens * q // t * a
    return AttentionSaved(attention - core if layout.recompute == "selective" else attention, core)


def qk_norm_weights(c, layout):
    """QK-norm's q_norm and k_norm (c.qk_norm) of each head met this rank's heads alone, sp or not:
    tp.split_attention sums their gradients. Over a whole projection (OLMo 2's) they are split with the heads
    (tp.split_projection_norm): none."""
    return [c.head_dim] * 2 * (c.qk_norm and c.qk_norm_scope == "head")


GROUPED_ATTENTION = Attention(grouped_attention_activations, qk_norm_weights, lambda c: c.d_model)


def latent_attention_activations(c, layout, tokens):
    """model.py's LatentAttention (DeepSeek-V2, section 2.1): what each of its operators saves, per token.
    Before tp's region, on this rank's tokens (1/tp of them under sp; tp.split_latent_attention): the input x
    that q_down and kv_down read; the queries' bottleneck norm (q_down_norm, an RMSNorm); the latent's norm
    (kv_down_norm, whose input is a view of kv_down's output latent | shared rotary key). Replicated over tp,
    on every token of the micro-batch: the compressed tokens (queries' latent | latent | rotary key, made by
    torch.cat and gathered under sp), of which q_up's and kv_up's inputs are views (on one rank of tp, the
    norms' outputs themselves: nothing enters a region); the cos and sin of the two
    rotations (of the rope features alone). This rank's heads: the core's inputs (q and k, made by torch.cat,
    and v, a view of kv_up's output, so that whole output) and what the core keeps (latent_core); proj's
    input, the heads' outputs, unless it is the core's own output read in place."""
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    own_tokens = tokens // t if layout.sp else tokens
    x = own_tokens * c.d_model * a
    queries = rms_norm_activations(own_tokens, c.q_lora_rank, c.q_lora_rank, a) if c.q_lora_rank else 0
    latent = rms_norm_activations(own_tokens, c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim, a)
    if t > 1:  # q_up's and kv_up's inputs: views of the compressed tokens, concatenated to enter the region
        latent += tokens * compressed_features(c) * a
    else:  # the norms' own outputs (without a query bottleneck, x itself, counted already)
        latent += tokens * (c.q_lora_rank + c.kv_lora_rank) * a
    rotations = 2 * position_rows(layout) * (c.seq_len // layout.cp) * c.rotary_dim * wide
    inputs = tokens * (c.q_dim + c.kv_dim + c.n_head * (c.qk_nope_head_dim + c.v_head_dim)) // t * a
    outputs = tokens * c.v_dim // t * a
    core = LATENT_CORES[latent_core(c, layout)]
    own = core.own(c, layout, tokens)
    selective = layout.recompute == "selective"  # the checkpoint keeps the core's inputs, not its own tensors
    proj_input = 0 if core.output_in_place and not proj_copies_heads(c, layout) and not selective else outputs
    kept = x + queries + latent + rotations + proj_input
    if selective or core.keeps_inputs:
        kept += inputs
    return AttentionSaved(kept if selective else kept + own, own)


def rms_norm_activations(tokens, width, input_width, a):
    """An RMSNorm over `width` features (norm_activations, PyTorch's composite on CPUs): x/rms and 1/rms in
    float32 or wider, and its input: itself, which may be a view of `input_width` features a token (its whole
    storage), or narrower than float32, a copy of it cast up."""
    wide = max(a, 4)
    kept_input = input_width * a if a == wide else width * wide
    return tokens * (width * wide + wide + kept_input)


class LatentCore(NamedTuple):
    """An attention core given latent attention's q, k (head_dim features) and v (v_head_dim): own (c, layout,
    tokens) -> the bytes it keeps of its own; keeps_inputs: whether it keeps q, k and v themselves too;
    output_in_place: whether what it keeps of its output is the tensor proj reads (in place, one head a rank)."""
    own: Callable
    keeps_inputs: bool
    output_in_place: bool


def latent_core(c, layout):
    """Which core runs: context parallelism's (cp.py: 'ring', 'allgather', 'alltoall'), or on one device cp.py's
    one-device core ('one device', cp.AttentionCore), which keeps what a fused kernel keeps whatever the
    kernel (the written-out blocks too: their scores are made again in backward)."""
    return layout.cp_mode if layout.cp > 1 else "one device"


def kernel_output(c, layout, tokens):
    """What a fused core keeps of its own: its output (this rank's heads, v_head_dim features each) and its
    log-sum-exp per head (no mask, see grouped_attention_activations)."""
    t, a = layout.tp, layout.activation_bytes
    return tokens * c.v_dim // t * a + tokens * c.n_head // t * max(a, 4)


def head_shard_copies(c, layout, tokens):
    """Ulysses's core (cp_mode alltoall): its head-shard copies of q, k and v, and kernel_output."""
    copies = tokens * (c.q_dim + c.kv_dim + c.v_dim) // layout.tp * layout.activation_bytes
    return copies + kernel_output(c, layout, tokens)


LATENT_CORES = {"one device": LatentCore(kernel_output, True, True),
                "ring": LatentCore(kernel_output, True, True), "allgather": LatentCore(kernel_output, True, True),
                "alltoall": LatentCore(head_shard_copies, False, False)}


def latent_replicated_weights(c, layout):
    """tp.split_latent_attention treats q_down, q_down_norm (with a query bottleneck), kv_down and kv_down_norm
    as norms: replicated, and under sp applied to this rank's tokens alone, their gradients summed."""
    if not layout.sp:
        return []
    queries = [c.q_lora_rank * c.d_model, c.q_lora_rank] if c.q_lora_rank else []
    return [*queries, (c.kv_lora_rank + c.qk_rope_head_dim) * c.d_model, c.kv_lora_rank]


def compressed_features(c):
    """What a token enters latent attention's tensor-parallel region with (LatentAttention.compressed): the
    queries' latent (x itself without a query bottleneck), the keys' and values' latent, the shared rotary key."""
    return (c.q_lora_rank or c.d_model) + c.kv_lora_rank + c.qk_rope_head_dim


LATENT_ATTENTION = Attention(latent_attention_activations, latent_replicated_weights, compressed_features)


def head_norm_activations(c, layout, tokens):
    """QK-norm's (c.qk_norm): q_norm and k_norm each keep what an RMSNorm keeps of this rank's heads, x/rms and
    1/rms (qk_norm_statistics) in float32 or wider, and their input: narrower than float32, a copy cast up; else a
    view of q | k | v, whose storage is kept already where the attention core keeps its inputs (rotated_kept),
    but not by Ulysses's (which keeps its own copies). Their outputs are new tensors: the rotation that follows
    keeps only its cos and sin, but without one the core keeps them where it keeps its inputs."""
    if not c.qk_norm:
        return 0
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    features = tokens * (c.q_dim + c.kv_dim) // t
    kept = features * wide + qk_norm_statistics(c, layout, tokens) * wide
    if a < wide:
        kept += features * wide
    elif not rotated_kept(layout):
        kept += tokens * (c.q_dim + 2 * c.kv_dim) // t * a
    if c.position != "rope" and rotated_kept(layout):
        kept += features * a
    return kept


def qk_norm_statistics(c, layout, tokens):
    """QK-norm's 1/rms a rank keeps: one a head of each token's q and k (this rank's heads), or over a whole
    projection (ProjectionNorm) one for each token's q and one for its k, whatever heads a rank holds."""
    if c.qk_norm_scope == "projection":
        return 2 * tokens
    return tokens * (c.n_head + c.n_kv_heads) // layout.tp


def position_rows(layout):
    """Rows of positions a micro-batch has: one for all its sequences, or with packed documents one a sequence
    (each restarts at its documents' first tokens)."""
    return layout.micro_batch if layout.documents else 1


def rotated_kept(layout):
    """Whether the rotated q and k are kept for backward: the attention core keeps its inputs (one device,
    ring attention, the all-gather), or selective recomputation keeps the inputs of the core it reruns;
    Ulysses's core (cp_mode alltoall) keeps its head-shard copies of them instead."""
    return layout.cp == 1 or layout.cp_mode != "alltoall" or layout.recompute == "selective"


def proj_copies_heads(c, layout):
    """Whether the attention's output projection keeps its own contiguous copy of the heads' outputs: ring
    attention and the all-gather return them head-major, and Ulysses's in new tensors; cp.py's one-device
    core returns them token-major (`cp._token_major`), as the projection reads them in place. A rank with
    one head has them contiguous either way."""
    return c.n_head // layout.tp > 1 and layout.cp > 1
