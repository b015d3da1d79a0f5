"""The single-device GPT: shapes, the two parallelism seams, routing, MoE and sampling.

Every numerical comparison runs in float64, so tolerances are tight: where two
computations differ only by the order of floating-point operations, rtol ~1e-12.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from training.meter import ActivationMeter
from model import (GPT, IGNORE, KVCache, MoE, GPTConfig, apply_recomputation, causal_attention, document_ids,
                   document_targets, load_balancing_loss, route, rotary, rotary_frequencies,
                   token_positions, end_moe_step, visible)

TINY = dict(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16)
LLAMA = dict(n_head=4, n_kv_heads=2, position="rope", norm="rms", mlp="swiglu", bias=False, d_ff=40)
QWEN3 = dict(LLAMA, head_dim=6, qk_norm=True)  # heads wider than d_model / n_head (4 of 6: q is 24 wide), QK-norm


def tiny_gpt(seed=0, **overrides):
    """A small float64 GPT, initialised from a fixed seed."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides})).double()


def random_tokens(batch, seq, vocab=TINY["vocab_size"], seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def explicit_attention(q, k, v, mask):
    """softmax(q kᵀ / √d, masked where mask is True) v, written out by hand (k, v with as many heads as q)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # grouped-query attention
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def attention_masked_by_positions(pos):
    """An attention core where query i sees key j exactly when pos[j] <= pos[i]."""
    def core(q, k, v, documents=None, window=None, sinks=None):  # (no documents, windows or sinks here)
        return explicit_attention(q, k, v, pos[None, :] > pos[:, None])
    return core


# 1. Shapes and the dense loss -------------------------------------------------

def test_forward_shapes_and_dense_loss_is_cross_entropy():
    model = tiny_gpt()
    idx, targets = random_tokens(3, 10), random_tokens(3, 10, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, TINY["vocab_size"])
    assert loss.dim() == 0
    expected = F.cross_entropy(logits.reshape(-1, TINY["vocab_size"]), targets.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)


def test_forward_without_targets_returns_no_loss():
    logits, loss = tiny_gpt()(random_tokens(2, 5))
    assert logits.shape == (2, 5, TINY["vocab_size"]) and loss is None


# 2. Explicit positions and the context-parallel seam --------------------------

def test_default_positions_are_arange():
    model, idx = tiny_gpt(), random_tokens(2, 12)
    torch.testing.assert_close(model(idx)[0], model(idx, pos=torch.arange(12))[0], rtol=0, atol=0)


def test_positions_change_the_output():
    """pos is really used: shifted positions give different logits."""
    model, idx = tiny_gpt(), random_tokens(2, 8)
    assert not torch.allclose(model(idx)[0], model(idx, pos=torch.arange(8) + 4)[0])


def test_position_masking_core_equals_causal_core_in_order():
    """On the natural order, the position-masked core is the causal core."""
    model, idx = tiny_gpt(), random_tokens(2, 12)
    expected = model(idx)[0]
    for block in model.blocks:
        block.attn.core = attention_masked_by_positions(torch.arange(12))
    torch.testing.assert_close(model(idx)[0], expected, rtol=1e-12, atol=1e-14)


def test_permuted_shard_with_explicit_positions_matches_after_core_swap():
    """A non-contiguous (permuted) sequence with explicit positions gives the
    permuted logits of the original order, once the core masks by position."""
    seq = 12
    model, idx = tiny_gpt(), random_tokens(2, seq)
    expected = model(idx)[0]
    perm = torch.randperm(seq, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(perm, torch.arange(seq))

    # With the plain causal core, position order is ignored: the result is wrong.
    plain = model(idx[:, perm], pos=perm)[0]
    assert not torch.allclose(plain, expected[:, perm], rtol=1e-6, atol=1e-6)

    for block in model.blocks:
        block.attn.core = attention_masked_by_positions(perm)
    permuted = model(idx[:, perm], pos=perm)[0]
    torch.testing.assert_close(permuted, expected[:, perm], rtol=1e-12, atol=1e-14)


# 3. The attention core --------------------------------------------------------

def test_causal_attention_equals_explicit_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 5, dtype=torch.float64, generator=g) for _ in range(3))
    causal_mask = torch.ones(7, 7, dtype=torch.bool).triu(1)  # key j > query i is hidden
    torch.testing.assert_close(causal_attention(q, k, v), explicit_attention(q, k, v, causal_mask),
                               rtol=1e-12, atol=1e-14)


# 4. Routing -------------------------------------------------------------------

def test_route_reproduces_the_article_example():
    probs = torch.tensor([[0, .05, .60, 0, 0, .35, 0, 0]], dtype=torch.float64)
    gates, experts, out_probs = route(torch.log(probs + 1e-12), top_k=2)
    assert experts.tolist() == [[2, 5]]
    torch.testing.assert_close(gates, torch.tensor([[0.60 / 0.95, 0.35 / 0.95]], dtype=torch.float64),
                               rtol=1e-9, atol=0)
    torch.testing.assert_close(out_probs, probs, rtol=0, atol=1e-10)


def test_route_gates_sum_to_one_and_pick_the_largest_probs():
    logits = torch.randn(50, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gates, experts, probs = route(logits, top_k=3)
    torch.testing.assert_close(gates.sum(-1), torch.ones(50, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(probs, logits.softmax(-1), rtol=1e-12, atol=0)
    # the chosen experts are the three most probable, and gates are their renormalised probs
    third_largest = probs.sort(-1, descending=True).values[:, 2:3]
    assert (probs.gather(1, experts) >= third_largest).all()
    chosen = probs.gather(1, experts)
    torch.testing.assert_close(gates, chosen / chosen.sum(-1, keepdim=True), rtol=1e-12, atol=0)


def test_route_computes_in_at_least_float32():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    gates, _, probs = route(logits.bfloat16(), top_k=2)
    assert probs.dtype == torch.float32 and gates.dtype == torch.float32
    gates, _, probs = route(logits.double(), top_k=2)
    assert probs.dtype == torch.float64 and gates.dtype == torch.float64


# 5. Load-balancing loss -------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 2])
def test_load_balancing_loss_is_one_for_uniform_routing(top_k):
    n_experts, tokens = 4, 8
    probs = torch.full((tokens, n_experts), 1 / n_experts, dtype=torch.float64)
    experts = torch.arange(tokens * top_k).remainder(n_experts).view(tokens, top_k)
    assert torch.bincount(experts.flatten()).tolist() == [tokens * top_k // n_experts] * n_experts
    loss = load_balancing_loss(probs, experts, n_experts)
    torch.testing.assert_close(loss, torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)


def test_load_balancing_loss_is_n_experts_when_all_tokens_pick_expert_zero():
    n_experts, tokens = 5, 7
    probs = torch.zeros(tokens, n_experts, dtype=torch.float64)
    probs[:, 0] = 1
    experts = torch.zeros(tokens, 1, dtype=torch.long)
    loss = load_balancing_loss(probs, experts, n_experts)
    torch.testing.assert_close(loss, torch.tensor(float(n_experts), dtype=torch.float64), rtol=1e-12, atol=0)


def test_load_balancing_loss_matches_hand_written_formula():
    g = torch.Generator().manual_seed(0)
    n_experts, tokens, top_k = 6, 40, 2
    probs = torch.randn(tokens, n_experts, dtype=torch.float64, generator=g).softmax(-1)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    expected = 0.0
    for i in range(n_experts):
        f_i = (experts == i).sum().item() / (tokens * top_k)
        P_i = sum(probs[t, i].item() for t in range(tokens)) / tokens
        expected += f_i * P_i
    loss = load_balancing_loss(probs, experts, n_experts)
    assert loss.item() == pytest.approx(n_experts * expected, rel=1e-12)


# 6. Mixture of experts ---------------------------------------------------------

def moe_layer(n_experts=4, top_k=2, d_model=8, seed=0):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=1, d_model=d_model, d_ff=12,
                       n_experts=n_experts, top_k=top_k)
    moe = MoE(config).double()
    with torch.no_grad():  # larger weights and non-zero biases, so a missing term would show
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    return moe


def moe_by_token_loop(moe, x):
    """sum over each token's top-k experts of gate * expert(token), one token at a time."""
    out = torch.zeros_like(x.reshape(-1, x.shape[-1]))
    for t, token in enumerate(x.reshape(-1, x.shape[-1])):
        probs = (moe.router.weight @ token).softmax(-1)
        top = probs.topk(moe.top_k)
        for p, e in zip(top.values, top.indices):
            out[t] += p / top.values.sum() * moe.experts[e](token[None])[0]
    return out.view_as(x)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_equals_a_per_token_loop(top_k):
    moe = moe_layer(top_k=top_k)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), moe_by_token_loop(moe, x), rtol=1e-12, atol=1e-14)
    assert moe.aux_loss is not None and moe.aux_loss.dim() == 0


def test_moe_with_an_expert_that_receives_no_token():
    """Expert 3 can never be in the top-2: inputs have a positive first feature and
    only expert 3's router row reads it, with a hugely negative weight."""
    moe = moe_layer(n_experts=4, top_k=2)
    with torch.no_grad():
        moe.router.weight[:, 0] = 0
        moe.router.weight[3] = 0
        moe.router.weight[3, 0] = -1e3
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x[..., 0] = x[..., 0].abs() + 1
    _, experts, _ = route(moe.router(x.reshape(-1, 8)), 2)
    assert not (experts == 3).any()
    assert set(experts.flatten().tolist()) == {0, 1, 2}  # the other experts are all used

    y = moe(x)
    torch.testing.assert_close(y, moe_by_token_loop(moe, x), rtol=1e-12, atol=1e-14)
    (y.square().sum() + moe.aux_loss).backward()
    for e, expert in enumerate(moe.experts):
        for p in expert.parameters():
            if e == 3:
                assert p.grad is None
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0
    assert moe.router.weight.grad is not None


# 7. GPT with MoE and config validation ---------------------------------------

def test_gpt_moe_layers_selects_blocks_and_adds_aux_loss():
    model = tiny_gpt(n_layer=3, n_experts=4, top_k=2, moe_layers=(1,))
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == [False, True, False]
    idx, targets = random_tokens(2, 10), random_tokens(2, 10, seed=2)
    logits, loss = model(idx, targets)
    aux = model.blocks[1].mlp.aux_loss
    assert aux.dim() == 0 and aux.item() > 0
    ce = F.cross_entropy(logits.reshape(-1, TINY["vocab_size"]), targets.reshape(-1))
    torch.testing.assert_close(loss, ce + model.config.aux_loss_coef * aux, rtol=1e-12, atol=0)
    assert not torch.allclose(loss, ce)  # the aux term is really there


def test_gpt_without_moe_layers_makes_every_block_moe():
    model = tiny_gpt(n_experts=2, top_k=1)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)


@pytest.mark.parametrize("bad", [
    dict(d_model=18, n_head=4),
    dict(n_experts=2, top_k=3),
    dict(n_experts=2, top_k=0),
    dict(n_experts=2, top_k=1, n_layer=2, moe_layers=(2,)),
    dict(n_experts=2, top_k=1, n_layer=2, moe_layers=(-1,)),
    dict(n_experts=2, top_k=1, d_shared=8),  # a shared expert's width, without a shared expert
    dict(n_experts=2, top_k=1, shared_expert_gate=True),
])
def test_config_validation_raises(bad):
    with pytest.raises(ValueError):
        GPTConfig(**{**TINY, **bad})


# 8. Generation ----------------------------------------------------------------

def test_generate_shape_and_keeps_the_prompt():
    model, prompt = tiny_gpt(), random_tokens(2, 5)
    out = model.generate(prompt, 4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 9) and out.dtype == prompt.dtype
    assert torch.equal(out[:, :5], prompt)
    assert ((out >= 0) & (out < TINY["vocab_size"])).all()


def test_generate_is_deterministic_with_a_seeded_generator():
    model, prompt = tiny_gpt(), random_tokens(2, 5)
    runs = [model.generate(prompt, 10, generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_generate_crops_a_prompt_longer_than_seq_len():
    model = tiny_gpt()
    prompt = random_tokens(1, 3 * TINY["seq_len"])
    out = model.generate(prompt, 3, top_k=1)
    assert out.shape == (1, 3 * TINY["seq_len"] + 3)
    # the first new token only depends on the last seq_len tokens of the prompt
    last = model(prompt[:, -TINY["seq_len"]:])[0][:, -1].argmax(-1)
    assert out[0, len(prompt[0])].item() == last.item()


def test_generate_with_top_k_one_is_greedy_decoding():
    model, prompt = tiny_gpt(), random_tokens(3, 4)
    idx = prompt
    for _ in range(TINY["seq_len"] + 4):  # long enough to crop the context too
        logits = model(idx[:, -TINY["seq_len"]:])[0][:, -1]
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    out = model.generate(prompt, TINY["seq_len"] + 4, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, idx)


# The key/value cache: the same tokens as running the whole context every step, for every kind of block
CACHED = {"gpt": {}, "llama-gqa": LLAMA, "qwen3-qk-norm": QWEN3, "gpt-moe": dict(n_experts=4, moe_layers=(1,)),
          "llama-moe": dict(LLAMA, n_experts=4, top_k=2, n_shared_experts=1),
          "llama-window-sinks": dict(LLAMA, sliding_window=3, window_layers=(0,), attention_sinks=True)}
SAMPLING = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0), "top-k": dict(temperature=0.8, top_k=5)}


def with_and_without_cache(model, prompt, new, **sampling):
    """generate's tokens with the cache and without it, each from a generator seeded alike."""
    return [model.generate(prompt, new, generator=torch.Generator().manual_seed(3), cache=cache, **sampling)
            for cache in (True, False)]


def test_kv_cache_attends_new_queries_to_the_keys_up_to_their_positions():
    """Fed in pieces (a prompt, then three tokens at once, then one), the cache attends each query to the keys
    up to its own position (within a window, the latest of them): causal attention over the whole sequence
    (here with grouped-query attention, and with sinks)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    for seen in ({}, dict(window=3, sinks=sinks)):  # and within a window of 3, with sinks
        cache = KVCache()
        pieces = [cache(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], **seen) for a, b in [(0, 5), (5, 8), (8, 9)]]
        torch.testing.assert_close(torch.cat(pieces, dim=2), causal_attention(q, k, v, **seen), rtol=1e-12,
                                   atol=1e-14)
        assert len(cache) == 9


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
@pytest.mark.parametrize("arch", CACHED.values(), ids=CACHED.keys())
def test_generate_with_the_kv_cache_gives_the_tokens_of_the_whole_context(arch, sampling):
    model, prompt = tiny_gpt(**arch), random_tokens(3, 5)
    cached, whole = with_and_without_cache(model, prompt, 10, **sampling)
    assert torch.equal(cached, whole)


@pytest.mark.parametrize("arch,sampling,prompt_len", [
    ("gpt", "greedy", 5), ("gpt", "sampled", 2 * TINY["seq_len"]),
    ("llama-gqa", "sampled", 5), ("llama-gqa", "greedy", 2 * TINY["seq_len"]),
], ids=["gpt-greedy-outgrows", "gpt-sampled-longer-prompt", "llama-gqa-sampled-outgrows",
        "llama-gqa-greedy-longer-prompt"])
def test_generate_with_the_kv_cache_past_max_seq_len_slides_the_window_alike(arch, sampling, prompt_len):
    """Past max_seq_len every position of the window moves: the cache is rebuilt, and the tokens stay those
    of the whole window (learned positions would show a stale cache at once)."""
    model, prompt = tiny_gpt(**CACHED[arch]), random_tokens(2, prompt_len)
    cached, whole = with_and_without_cache(model, prompt, 2 * TINY["seq_len"], **SAMPLING[sampling])
    assert cached.shape == (2, prompt_len + 2 * TINY["seq_len"])
    assert torch.equal(cached, whole)


@pytest.mark.parametrize("sampling", [SAMPLING["greedy"], SAMPLING["top-k"]], ids=["greedy", "top-k"])
def test_generate_with_the_kv_cache_finishes_rows_at_eos_alike(sampling):
    """Four rows, the first ending at its second new token: it is padded with EOS while the others go on,
    with the cache as without it."""
    model, prompt = tiny_gpt(), random_tokens(4, 5)
    free = with_and_without_cache(model, prompt, 12, **sampling)[1]
    eos = free[0, 6].item()
    cached, whole = with_and_without_cache(model, prompt, 12, eos_id=eos, **sampling)
    assert torch.equal(cached, whole)
    assert (cached[0, 6:] == eos).all() and (cached[1:, 7:] != eos).any()  # row 0 done early, another row not


def test_generate_with_the_kv_cache_runs_one_token_a_step_after_the_prompt():
    """The first block's input, step by step: with the cache the prompt once, then one token a step until the
    sequence outgrows the window, then the whole (slid) window; without it, the whole context every step."""
    model, prompt, window = tiny_gpt(), random_tokens(2, 5), TINY["seq_len"]
    lengths = []
    model.blocks[0].register_forward_pre_hook(lambda block, args: lengths.append(args[0].shape[1]))
    model.generate(prompt, 14, temperature=0)
    assert lengths == [5] + [1] * (window - 5) + [window] * 2
    lengths.clear()
    model.generate(prompt, 14, temperature=0, cache=False)
    assert lengths == [min(5 + step, window) for step in range(14)]
    assert all(block.attn.core is causal_attention for block in model.blocks)  # the cores are given back


# 9. The Llama-style block -------------------------------------------------------

def test_llama_block_has_no_biases_no_position_table_and_gqa_shapes():
    model = tiny_gpt(**LLAMA)
    assert model.pos_emb is None
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    head_dim = TINY["d_model"] // 4
    assert attn.qkv.out_features == (4 + 2 * 2) * head_dim  # 4 query heads, 2 key and 2 value heads
    assert mlp.fc.out_features == 2 * 40 and mlp.proj.in_features == 40  # SwiGLU: gate | up
    assert isinstance(model.blocks[0].norm1, nn.RMSNorm)


def test_grouped_query_attention_equals_attention_with_repeated_key_value_heads():
    """Each key/value head serves the consecutive query heads of its group (as Llama's repeat_kv)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(2))
    repeated = [t[:, [0, 0, 0, 1, 1, 1]] for t in (k, v)]
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    torch.testing.assert_close(causal_attention(q, k, v), explicit_attention(q, *repeated, mask),
                               rtol=1e-12, atol=1e-14)


def test_rotary_scores_depend_only_on_the_difference_of_positions():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=g) for _ in range(2))
    frequencies = rotary_frequencies(GPTConfig(), 8, torch.float64, "cpu")
    def score(p_q, p_k):
        return (rotary(q, torch.tensor([p_q]), frequencies) * rotary(k, torch.tensor([p_k]), frequencies)).sum().item()
    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-6)
    torch.testing.assert_close(rotary(q, torch.tensor([0]), frequencies), q)  # position 0: no turn
    turned = rotary(q, torch.tensor([5]), frequencies)
    torch.testing.assert_close(turned.norm(), q.norm())  # a rotation keeps lengths


def test_llama_with_explicit_positions_matches_on_a_permuted_sequence():
    """Rotary positions come from pos, not from the place in the sequence: a permuted sequence with its
    positions, and an attention core that masks by those positions, gives the permuted logits."""
    model = tiny_gpt(**LLAMA)
    idx = random_tokens(2, 12)
    expected, _ = model(idx)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    for block in model.blocks:
        block.attn.core = attention_masked_by_positions(perm)
    logits, _ = model(idx[:, perm], pos=perm)
    torch.testing.assert_close(logits, expected[:, perm], rtol=1e-10, atol=1e-12)


def test_wide_heads_with_qk_norm_equal_the_attention_written_out():
    """Heads of head_dim, not d_model / n_head (Qwen3, Mistral NeMo): q is n_head x head_dim wide, k and v
    n_kv_heads x head_dim, proj maps n_head x head_dim back to d_model; QK-norm normalises each head's q and k
    (an RMSNorm over its head_dim features, one weight for every head) before the rotation, as Qwen3's
    attention does (q_norm(q_proj(x).view(..., head_dim)), then apply_rotary_pos_emb)."""
    config = GPTConfig(**{**TINY, **QWEN3})
    model = tiny_gpt(**QWEN3)
    attn = model.blocks[0].attn
    assert (attn.qkv.out_features, attn.proj.in_features, attn.proj.out_features) == (24 + 2 * 12, 24, 16)
    assert torch.equal(attn.q_norm.weight, torch.ones(6)) and torch.equal(attn.k_norm.weight, torch.ones(6))
    with torch.no_grad():  # weights of their own, so that a norm applied to the wrong tensor shows
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    x, pos = torch.randn(2, 16, 16, dtype=torch.float64), torch.arange(16)
    q, k, v = (t.unflatten(-1, (-1, 6)).transpose(1, 2) for t in attn.qkv(x).split([24, 12, 12], -1))

    def rms_norm(t, weight):
        return t / (t.pow(2).mean(-1, keepdim=True) + config.norm_eps).sqrt() * weight

    def rotate(t):  # Llama's rotate_half layout: pairs (i, i + 3) turned by pos * theta^(-i/3)
        angles = pos[:, None].double() * config.rope_theta ** (-torch.arange(3, dtype=torch.float64) / 3)
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        return t * cos + torch.cat([-t[..., 3:], t[..., :3]], -1) * sin

    q, k = rotate(rms_norm(q, attn.q_norm.weight)), rotate(rms_norm(k, attn.k_norm.weight))
    y = explicit_attention(q, k, v, torch.ones(16, 16, dtype=torch.bool).triu(1))
    expected = attn.proj(y.transpose(1, 2).flatten(2))
    torch.testing.assert_close(attn(x, pos), expected, rtol=1e-12, atol=1e-14)


def test_swiglu_mlp_is_silu_gate_times_up():
    model = tiny_gpt(**LLAMA)
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 16, dtype=torch.float64)
    gate, up = mlp.fc.weight[:40], mlp.fc.weight[40:]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-14)


def test_shared_expert_is_added_to_every_token():
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**TINY, n_experts=4, top_k=2, n_shared_experts=2)).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert moe.shared.proj.in_features == 2 * moe.experts[0].proj.in_features
    routed = moe_by_token_loop(moe, x)
    torch.testing.assert_close(moe(x), routed + moe.shared(x), rtol=1e-12, atol=1e-14)


# Qwen's mixtures of experts: an expert's own width, dense layers between, gates as the softmax gave them, and
# Qwen2-MoE's shared expert of its own width behind a sigmoid gate
QWEN2_MOE = dict(LLAMA, n_layer=3, moe_layers=(0, 2), n_experts=4, top_k=2, d_expert=12, n_shared_experts=1,
                 d_shared=20, shared_expert_gate=True, norm_topk_prob=False)


def qwen2_moe_by_token_loop(moe, x):
    """Hugging Face's Qwen2MoeSparseMoeBlock written out a token at a time: the top-k softmax probabilities as
    they are (norm_topk_prob False) times their experts, plus sigmoid(x . w) times the shared expert."""
    out = torch.zeros_like(x.reshape(-1, x.shape[-1]))
    for t, token in enumerate(x.reshape(-1, x.shape[-1])):
        top = (moe.router.weight @ token).softmax(-1).topk(moe.top_k)
        for p, e in zip(top.values, top.indices):
            out[t] += p * moe.experts[e](token[None])[0]
        out[t] += torch.sigmoid(moe.shared_gate.weight[0] @ token) * moe.shared(token[None])[0]
    return out.view_as(x)


def test_qwen2_moe_widths_dense_layers_and_gated_shared_expert():
    model = tiny_gpt(**QWEN2_MOE)
    dense, moe = model.blocks[1].mlp, model.blocks[0].mlp
    assert not isinstance(dense, MoE) and dense.proj.in_features == 40  # the dense layers keep d_ff
    assert [e.proj.in_features for e in moe.experts] == [12] * 4 and moe.shared.proj.in_features == 20
    assert moe.shared_gate.weight.shape == (1, TINY["d_model"]) and moe.shared_gate.bias is None
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), qwen2_moe_by_token_loop(moe, x), rtol=1e-12, atol=1e-14)
    gates, _, _ = route(moe.router(x.reshape(-1, 16)), 2, renormalise=False)
    assert (gates.sum(-1) < 1).all()  # not renormalised: what the other experts had is left out


def test_moe_widths_default_to_the_dense_mlps():
    config = GPTConfig(**TINY, n_experts=4, n_shared_experts=2)
    assert (config.d_expert, config.d_shared) == (config.d_ff, 2 * config.d_ff)
    assert GPTConfig(**TINY, n_experts=4, d_expert=8, n_shared_experts=3).d_shared == 24


def test_routing_bias_chooses_experts_but_leaves_the_gates_unbiased():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    gates, experts, probs = route(logits, 2, bias=torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64))
    assert experts.tolist() == [[3, 0]]  # chosen by probs + bias
    torch.testing.assert_close(gates, probs[:, [3, 0]] / probs[:, [3, 0]].sum())


def test_bias_balancing_evens_out_the_tokens_of_a_skewed_router():
    """A router that sends most tokens to expert 0: after steps of bias updates alone (no training), the
    tokens per expert are much closer to even, and the biases moved against the load."""
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**TINY, n_experts=4, top_k=1, bias_update_rate=0.02)).double()
    with torch.no_grad():
        moe.router.weight[0] += 0.2  # expert 0's logit grows with the sum of the (positive) features
    x = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).abs()
    def spread():
        with torch.enable_grad():
            moe(x)
        load = moe.load.clone()
        end_moe_step(moe)
        return load
    first = spread()
    for _ in range(60):
        last = spread()
    assert first.max() >= 60                # skewed: almost all 64 tokens on one expert
    assert last.max() - last.min() <= 12   # then within a few tokens of the fair 16 each
    assert moe.route_bias[0] < 0 and moe.route_bias.argmin() == 0
    assert moe.load.sum() == 0  # the loads restart after every update


def test_evaluation_forward_does_not_count_tokens():
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**TINY, n_experts=4, top_k=2)).double()
    with torch.no_grad():
        moe(torch.randn(5, 16, dtype=torch.float64))
    assert moe.load.sum() == 0
    moe(torch.randn(5, 16, dtype=torch.float64))
    assert moe.load.sum() == 10


@pytest.mark.parametrize("bad", [dict(n_head=4, n_kv_heads=3), dict(n_head=4, n_kv_heads=8), dict(norm="batch"),
                                 dict(mlp="relu"), dict(position="alibi"), dict(d_model=12, n_head=4, position="rope"),
                                 dict(head_dim=5, position="rope"), dict(head_dim=-8)])
def test_llama_config_validation_raises(bad):
    with pytest.raises(ValueError):
        GPTConfig(**{**TINY, **bad})


def test_head_dim_is_its_own_setting():
    """0 means d_model / n_head; given, it need not divide d_model (18 wide, 4 heads of 4: q is 16 wide)."""
    assert GPTConfig(**TINY).head_dim == 8
    config = GPTConfig(**{**TINY, "d_model": 18, "n_head": 4, "head_dim": 4})
    assert (config.q_dim, config.kv_dim) == (16, 16)
    with pytest.raises(ValueError, match="d_model=18 is not divisible by n_head=4: give head_dim"):
        GPTConfig(**{**TINY, "d_model": 18, "n_head": 4})


# 10. Activation recomputation ------------------------------------------------------

def saved_and_grads(mode, n_layer, **config):
    """Peak bytes saved for backward by a float64 GPT under a recomputation mode, and its gradients."""
    model = tiny_gpt(n_layer=n_layer, seq_len=32, **config)
    apply_recomputation(model, mode)
    idx = random_tokens(2, 32)
    meter = ActivationMeter(list(model.parameters()))
    with meter:
        _, loss = model(idx, idx)
    loss.backward()
    return meter.peak, {name: p.grad for name, p in model.named_parameters()}, model


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(mode):
    _, expected, _ = saved_and_grads("none", 2, **LLAMA)
    _, grads, _ = saved_and_grads(mode, 2, **LLAMA)
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name  # the same operations again: bit for bit


def test_recomputation_memory_per_block_follows_the_formula():
    """Per block (the difference between 3 and 1 layers, over 2): full keeps exactly its input, b*s*h;
    selective drops what the attention core saves besides its inputs and output: with PyTorch's fused
    kernel (used on CPU in float64 too) that is the log-sum-exp, b*heads*s, not the s^2 probabilities."""
    b, s, h, heads, itemsize = 2, 32, TINY["d_model"], TINY["n_head"], 8
    per_block = {mode: (saved_and_grads(mode, 3)[0] - saved_and_grads(mode, 1)[0]) // 2
                 for mode in ("none", "selective", "full")}
    assert per_block["full"] == b * s * h * itemsize
    assert per_block["none"] - per_block["selective"] == b * heads * s * itemsize
    assert per_block["none"] > 10 * per_block["full"]


def test_a_recomputed_moe_counts_its_tokens_once():
    _, _, model = saved_and_grads("full", 2, n_experts=4, top_k=2)
    for block in model.blocks:
        assert block.mlp.load.sum() == 2 * 32 * 2  # every token's two choices, once (not again in backward)


# Packed documents ------------------------------------------------------------------------------------------

EOS = 0


def packed_row(lengths, seed):
    """Documents of these lengths, each ended by EOS (their other ids never EOS), to lay back to back."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(1, TINY["vocab_size"], (n - 1,), generator=g), torch.tensor([EOS])])
            for n in lengths]


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt", "llama"])
def test_a_packed_document_gives_the_logits_and_loss_it_gives_alone(arch):
    """Logits at every position of a packed row are those of its document run alone from its first token, and
    the loss is the mean over every document's own next-token losses, the EOS's prediction of the next
    document's first token left out."""
    model = tiny_gpt(**arch)
    rows = [packed_row([5, 1, 7, 3], seed=2), packed_row([16], seed=3), packed_row([2, 9, 1, 4], seed=4),
            packed_row([6, 12], seed=5)]  # the last row's second document cut short by the window
    rows[-1][-1] = rows[-1][-1][:10]
    idx = torch.stack([torch.cat(row) for row in rows])  # (4, 16)
    targets = torch.cat([idx[:, 1:], random_tokens(4, 1)], dim=1)
    documents = document_ids(idx, EOS)
    logits, loss = model(idx, document_targets(idx, targets, EOS), documents=documents)
    own_losses = []
    for b, row in enumerate(rows):
        start = 0
        for document in row:
            alone = model(document[None])[0][0]
            torch.testing.assert_close(logits[b, start:start + len(document)], alone, rtol=1e-12, atol=1e-12)
            own = F.cross_entropy(alone[:-1], document[1:], reduction="none")  # within the document
            own_losses.append(own)
            start += len(document)
        last_target = targets[b, -1]  # the row's last token predicts what follows the window: within its
        if idx[b, -1] != EOS:         # document unless that token is an EOS
            own_losses.append(F.cross_entropy(logits[b, -1:], last_target[None], reduction="none"))
    torch.testing.assert_close(loss, torch.cat(own_losses).mean(), rtol=1e-12, atol=1e-12)


def test_document_ids_positions_and_mask():
    idx = torch.tensor([[3, EOS, 4, 5, EOS, EOS, 6]])
    documents = document_ids(idx, EOS)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert token_positions(torch.arange(7), documents).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert token_positions(torch.tensor([6, 2, 3]), documents).tolist() == [[0, 0, 1]]  # a shard's, in its order
    mask = visible(documents, None, torch.arange(7), torch.arange(7))[0, 0]
    expected = torch.tensor([[documents[0, j] == documents[0, i] and j <= i for j in range(7)] for i in range(7)])
    assert torch.equal(mask, expected)
    windowed = visible(documents, 2, torch.arange(7), torch.arange(7))[0, 0]  # itself and the one before
    assert torch.equal(windowed, expected & (torch.arange(7)[:, None] - torch.arange(7) < 2))
    assert torch.equal(visible(None, 2, torch.arange(7), torch.arange(7))[0, 0],
                       torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-2))
    assert document_targets(idx, idx, EOS).tolist() == [[3, IGNORE, 4, 5, IGNORE, IGNORE, 6]]
    assert torch.equal(token_positions(torch.arange(7), None), torch.arange(7))  # no documents: the index


def test_a_shard_with_no_counted_target_adds_zero_and_tokens_sets_the_divisor():
    model = tiny_gpt()
    idx = random_tokens(2, 8)
    ignored = torch.full_like(idx, IGNORE)
    assert model(idx, ignored, loss_tokens=3.0)[1].item() == 0.0
    targets = random_tokens(2, 8, seed=5)
    mean = model(idx, targets)[1]
    torch.testing.assert_close(model(idx, targets, loss_tokens=4)[1], mean * 16 / 4, rtol=1e-12, atol=0)
