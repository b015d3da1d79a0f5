"""DeepSeek-V3's family (--arch deepseek): multi-head latent attention, its router and YaRN, on one device and
through every dimension, each layout equal to the single device in float64 and to the counters of tools.plan.

Latent attention's keys have qk_nope_head_dim + qk_rope_head_dim features a head and its values v_head_dim
(the tiny preset's 8 + 4 and 6), so every way of context parallelism carries keys and values of two widths;
under tensor parallelism its down-projections act outside the region, as norms do, and its compressed tokens
enter the region together.
"""
import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import ep
from distributed import run_on_ranks
from model import GPT, MoE, GPTConfig, best_groups_only, load_balancing_loss, route, rotary_frequencies, yarn_gains
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from training import cli

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

DEEPSEEK = [*EQUIVALENCE, "--arch", "deepseek", "--layers", "4", "--steps", "2", "--batch-size", "16"]
# Experts in both balancing ways: DeepSeek-V3's balance loss per sequence and the routing bias, moved after
# every step.
EXPERTS = ["--experts", "4", "--top-k", "2", "--shared-experts", "1", "--balance", "both", "--bias-update-rate", "0.01",
           "--aux-loss-scope", "sequence"]
DOCUMENTS = ["--seq-len", "32", "--document-mask", "--eos-id", "16"]  # as tests/test_documents.py packs them

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    # latent attention alone
    (2, [], ["--tp", "2", "--sp", "--recompute", "full"]),
    (2, DOCUMENTS, ["--cp", "2", "--cp-mode", "ring"]),
    (2, DOCUMENTS, ["--cp", "2", "--cp-mode", "allgather", "--recompute", "selective"]),
    # (with experts balanced per sequence: their counts summed over cp, again when recomputed)
    (2, [*DOCUMENTS, *EXPERTS], ["--cp", "2", "--cp-mode", "alltoall", "--ep", "2", "--recompute", "full"]),
    (2, ["--micro-batches", "4"], ["--pp", "2", "--schedule", "zbv"]),  # backward split in two, a V of chunks
    # the router: folded over tp (without sp: the attention's tp without sp too), and limited to one group of
    # two experts a token, each group on its own rank
    (2, EXPERTS, ["--ep", "2", "--tp", "2"]),
    (2, [*EXPERTS, "--expert-groups", "2", "--group-top-k", "1"], ["--ep", "2"]),
    # everything at once, with ZeRO-3 and Muon (whose matrices ZeRO and tp cut)
    (8, [*EXPERTS, "--optimizer", "muon"], ["--tp", "2", "--pp", "2", "--ep", "2", "--zero", "3", "--sp"]),
]


def layout_id(world, model, flags):
    return f"{world}-" + "-".join(f.lstrip("-") for f in flags) + ("-experts" if EXPERTS[0] in model else "")


@pytest.mark.parametrize("world,model,flags", LAYOUTS, ids=[layout_id(*row) for row in LAYOUTS])
def test_layouts_train_as_one_device(tmp_path, world, model, flags):
    argv = [*DEEPSEEK, *model, *flags]
    results = run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=600)
    for result in results:
        assert_matches_oracle(result, oracle([*DEEPSEEK, *model]))
    assert_matches_plan(tmp_path, argv, world)


# ---------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------

def test_group_limited_routing_chooses_within_the_best_groups_only():
    """Four experts in two groups: the token's best single expert (index 0) is in the worse group by the sum of
    each group's two best, so with one group allowed it is passed over."""
    logits = torch.tensor([[3.0, -4.0, 1.5, 1.5]])
    gates, experts, probs = route(logits, 2, scoring="sigmoid", groups=(2, 1), scale=2.5)
    assert sorted(experts[0].tolist()) == [2, 3]
    scores = logits.sigmoid()
    torch.testing.assert_close(gates[0], 2.5 * scores[0, experts[0]] / scores[0, experts[0]].sum())
    torch.testing.assert_close(probs, scores / scores.sum())  # DeepSeek-V3's s', which the balance loss averages
    assert sorted(route(logits, 2, scoring="sigmoid")[1][0].tolist()) == [0, 2]  # unlimited: the best two


def test_the_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    gates, experts, _ = route(logits, 1, bias, scoring="sigmoid", renormalise=False)
    assert experts.tolist() == [[3]] and gates.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


@pytest.mark.parametrize("scoring,groups,renormalise", [("softmax", (1, 1), True), ("sigmoid", (4, 2), True),
                                                       ("sigmoid", (8, 3), False)])
def test_ep_routes_as_model_py(scoring, groups, renormalise):
    """ep.py's `route` is a deliberate copy of model.py's (each file stands alone): the same choices and gates."""
    generator = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(64, 16, generator=generator), 0.1 * torch.randn(16, generator=generator)
    ours = route(logits, 4, bias, renormalise, scoring, groups, 2.5)
    theirs = ep.route(logits, 4, bias=bias, variant=ep.RouterVariant(scoring, groups, renormalise, 2.5))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    masked = best_groups_only(logits, *groups)
    assert ((masked > -math.inf).sum(-1) == groups[1] * 16 // groups[0]).all()


def test_the_sequence_wise_balance_loss_is_deepseek_v3s():
    """Its equations 17-20, term by term, for each sequence of a micro-batch, averaged; the Switch loss over
    the micro-batch is the same formula with the micro-batch as one sequence."""
    generator = torch.Generator().manual_seed(0)
    n_experts, top_k, sequences, length = 8, 2, 3, 10
    scores = torch.rand(sequences, length, n_experts, generator=generator, dtype=torch.float64)
    probs = scores / scores.sum(-1, keepdim=True)  # s'
    experts = torch.rand(sequences, length, n_experts, generator=generator).topk(top_k, -1).indices
    per_sequence = []
    for s in range(sequences):
        f = [n_experts / (top_k * length) * (experts[s] == i).sum().item() for i in range(n_experts)]  # eq. 18
        p = [probs[s, :, i].sum().item() / length for i in range(n_experts)]  # eq. 20
        per_sequence.append(sum(f_i * p_i for f_i, p_i in zip(f, p)))  # eq. 17, without its alpha
    assert load_balancing_loss(probs, experts, n_experts).item() == pytest.approx(sum(per_sequence) / sequences,
                                                                                  rel=1e-14)
    whole = load_balancing_loss(probs.view(-1, n_experts), experts.view(-1, top_k), n_experts)
    assert whole.item() != pytest.approx(sum(per_sequence) / sequences, rel=1e-3)  # a different loss


def sequence_balance_worker():
    """2 ranks sharing 3 sequences as tensor parallelism does (with sp: each holds half of every sequence;
    without: the same tokens, each rank routing half of their rows, so the second sequence is split between
    the ranks): the loss per micro-batch and per sequence, and the router's gradient, against model.py's MoE
    on one device."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    data = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    errors = {}
    for scope, balance in [("batch", None), ("sequence", ep.SequenceBalance(group))]:
        config = GPTConfig(d_model=8, n_head=2, n_layer=1, vocab_size=16, n_experts=4, top_k=2,
                           router_scoring="sigmoid", aux_loss_scope=scope)
        torch.manual_seed(0)
        reference = MoE(config).to(torch.float64)
        reference(data)
        reference.aux_loss.backward()
        loss, gradient = reference.aux_loss.detach(), reference.router.weight.grad
        reference.aux_loss = None  # (a tensor in the graph: the layer could not be copied)
        for tokens, mine in [(ep.ShardedTokens(group), data.chunk(n, 1)[rank]), (ep.ReplicatedTokens(group), data)]:
            layer = ep.ExpertParallelMoE(copy.deepcopy(reference), group, group, tokens=tokens, balance=balance)
            layer.router.weight.grad = None
            layer(mine)
            layer.aux_loss.backward()
            dist.all_reduce(layer.router.weight.grad)  # (tp.py sums the router's gradient over the tp ranks)
            errors[scope, type(tokens).__name__] = max((layer.aux_loss - loss).abs().item(),
                                                       (layer.router.weight.grad - gradient).abs().max().item())
    return errors


def test_the_balance_loss_per_sequence_sums_its_counts_over_the_ranks_sharing_it():
    for errors in run_on_ranks(2, sequence_balance_worker):
        assert len(errors) == 4 and max(errors.values()) < 1e-14, errors


def test_a_layer_balancing_per_sequence_needs_the_ranks_sharing_them():
    with pytest.raises(ValueError, match="pass balance=SequenceBalance"):
        ep.ExpertParallelMoE(MoE(tiny_deepseek(aux_loss_scope="sequence")), None, None)


# ---------------------------------------------------------------------------
# YaRN
# ---------------------------------------------------------------------------

YARN = dict(position="rope", rope_type="yarn", rope_factor=40.0, rope_original_context=4096, rope_theta=10000.0,
            rope_mscale=1.0, rope_mscale_all_dim=1.0)


def test_yarn_keeps_the_fast_pairs_slows_the_slow_ones_and_ramps_between():
    """DeepSeek-V3's 64 rotated features: pairs that turn more than 32 times over the original 4,096 positions
    are kept, those turning less than once are 40 times slower, and the ramp between is linear in the pair."""
    config = GPTConfig(n_head=1, d_model=64, **YARN)
    plain = GPTConfig(n_head=1, d_model=64, position="rope").rope_theta ** (-torch.arange(32, dtype=torch.float64) / 32)
    yarn = rotary_frequencies(config, 64, torch.float64, "cpu")
    turns = 4096 * plain / (2 * math.pi)
    kept, slowed = turns > 32 * 1.5, turns < 1 / 1.5  # clear of the ramp's rounded ends
    assert torch.equal(yarn[kept], plain[kept]) and kept.any()
    torch.testing.assert_close(yarn[slowed], plain[slowed] / 40, rtol=1e-15, atol=0)
    ratio = (plain / yarn)[~kept & ~slowed]  # between: 1 / ((1 - r) + r / 40), r rising linearly
    ramp = (1 / ratio - 1) / (1 / 40 - 1)
    steps = ramp[1:] - ramp[:-1]
    torch.testing.assert_close(steps, steps[0].expand_as(steps), rtol=1e-9, atol=1e-12)


def test_yarn_gains_are_deepseek_v3s_and_qwens():
    mscale = 0.1 * math.log(40.0) + 1
    assert yarn_gains(GPTConfig(**YARN)) == (1.0, pytest.approx(mscale ** 2))  # DeepSeek-V3: softmax's scale
    qwen = dict(YARN, rope_mscale=0.0, rope_mscale_all_dim=0.0, rope_factor=4.0)
    assert yarn_gains(GPTConfig(**qwen)) == (pytest.approx(0.1 * math.log(4.0) + 1), 1.0)  # the rotated features'
    assert yarn_gains(GPTConfig(position="rope")) == (1.0, 1.0)


# ---------------------------------------------------------------------------
# Latent attention on one device
# ---------------------------------------------------------------------------

def tiny_deepseek(**changes):
    args = cli.parse_args([*DEEPSEEK, *EXPERTS, "--expert-groups", "2", "--group-top-k", "1"])
    return dataclasses.replace(cli.model_config(args, 64), **changes)


@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_generation_with_the_cache_equals_running_the_whole_context(q_lora_rank):
    """The key/value cache holds latent attention's per-head keys (their shared rotated part included) and
    values of their own width; with YaRN's gains too."""
    model = GPT(tiny_deepseek(q_lora_rank=q_lora_rank, **{k: v for k, v in YARN.items() if k != "rope_factor"},
                              rope_factor=4.0)).double()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    cached = model.generate(prompt, 8, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 8, temperature=0, cache=False))


def test_the_preset_is_deepseek_v3_671b_with_37b_active():
    """--model deepseek-v3 --arch deepseek, built on the meta device: the paper's 671B parameters (its table 1,
    without the multi-token-prediction module), of which 37B pass a token (8 of 256 routed experts)."""
    config = cli.model_config(cli.parse_args(["--model", "deepseek-v3", "--arch", "deepseek"]), 129280)
    with torch.device("meta"):
        model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.blocks[-1].mlp.experts[0].parameters())
    idle = len(config.moe_layers) * (config.n_experts - config.top_k) * expert
    assert round(total / 1e9) == 671 and round((total - idle) / 1e9) in (37, 38)
    assert config.moe_layers == tuple(range(3, 61)) and (config.n_group, config.topk_group) == (8, 4)


@pytest.mark.parametrize("fields,message", [
    (dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4), "needs position='rope'"),
    (dict(position="rope", v_head_dim=6), "only latent attention"),
    (dict(n_experts=8, n_group=3), "equal groups"),
    (dict(n_experts=8, n_group=4, topk_group=1, top_k=3), "top_k=3 of them from topk_group=1"),
])
def test_configs_model_py_cannot_build_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


@pytest.mark.parametrize("argv,message", [
    (["--model", "deepseek-v3", "--arch", "llama"], "add --arch deepseek"),
    (["--model", "gpt2", "--arch", "deepseek"], "no --arch deepseek shape"),
    (["--model", "mixtral"], "add --arch llama"),
])
def test_presets_without_that_architecture_are_refused(argv, message):
    with pytest.raises(cli.ConfigError, match=message):
        cli.model_config(cli.parse_args(argv), 256)


def test_values_of_their_own_width_take_kernels_that_accept_them():
    """PyTorch's flash kernels want one head size for q, k and v: on CPUs the written-out blocks, on CUDA the
    memory-efficient kernel, whose shapes (checked here on the meta device) keep the values' width."""
    import cp
    assert cp.default_kernels(torch.device("cpu"), torch.float32, 12, 6) is cp.EXPLICIT
    q, k = (torch.empty(2, 4, 16, 192, device="meta", dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(2, 4, 16, 128, device="meta", dtype=torch.bfloat16)
    out, lse = cp.cuda_efficient_block(q, k, v, True)
    grads = cp.cuda_efficient_block_backward(torch.empty_like(out), q, k, v, out, lse, True)
    assert out.shape == v.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
