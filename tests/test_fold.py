"""Experts folded over the attention ranks (mesh.py): --ep takes its ranks out of each pipeline stage's
dp x cp x tp, and --expert-tp splits the experts over some of them. Each layout equals the single device in
float64 under NCCL's matching by order alone (run_on_ranks) and equals tools/plan/'s counters.

Inside an MoE layer every rank of a stage routes tokens of its own: under tp without sp each tensor-parallel
rank takes its part of the tokens they all hold (ep.py's ReplicatedTokens), with sp its own sequence shard.
"""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import ep
import tp
from distributed import run_on_ranks
from model import GPTConfig, MoE
from training import cli
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker
from planned import assert_matches_plan

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

BASE = [*EQUIVALENCE, "--experts", "4", "--top-k", "2"]

# (ranks, flags, model flags): ep over tp with and without sp, over cp in its three modes, over dp, and over a
# mix; --expert-tp 1 and 2; under pipelines (one with a split backward) and ZeRO-1, 2 (hybrid) and 3; top-1 and
# top-2, shared experts, both balancing rules, both architectures, both optimizers (Muon: each expert's
# matrices orthogonalised where they are held).
LAYOUTS = [
    (2, ["--tp", "2", "--ep", "2"], ["--top-k", "1", "--shared-experts", "1"]),
    (2, ["--tp", "2", "--sp", "--ep", "2"], ["--balance", "both", "--arch", "llama", "--optimizer", "muon"]),
    (2, ["--tp", "2", "--expert-tp", "2"], []),
    (2, ["--cp", "2", "--ep", "2", "--zero", "1"], ["--balance", "bias"]),
    # ZeRO-3 with full recomputation: a recomputed MoE layer prefetches the next one's experts after their
    # reduction; that copy must not outlive the step (it once did, and the next step used the old weights)
    (2, ["--ep", "2", "--zero", "3", "--recompute", "full"], []),
    (2, ["--cp", "2", "--cp-mode", "allgather", "--ep", "2"], ["--shared-experts", "1"]),
    (2, ["--cp", "2", "--cp-mode", "alltoall", "--expert-tp", "2"], ["--top-k", "1"]),
    (4, ["--tp", "2", "--sp", "--ep", "4", "--zero", "3"], ["--shared-experts", "1", "--balance", "both"]),
    (4, ["--tp", "2", "--ep", "2", "--expert-tp", "2", "--zero", "1"], ["--top-k", "1"]),
    (4, ["--tp", "2", "--ep", "2", "--zero", "2", "--dp-shard", "1"], ["--balance", "bias"]),  # hybrid: 2 copies
    (4, ["--cp", "2", "--tp", "2", "--sp", "--ep", "2", "--expert-tp", "2", "--zero", "3"],
     ["--arch", "llama", "--shared-experts", "1"]),
    (4, ["--pp", "2", "--tp", "2", "--ep", "2", "--schedule", "zbv", "--zero", "1"],
     ["--layers", "4", "--micro-batches", "4", "--shared-experts", "1", "--balance", "both", "--optimizer", "muon"]),
    (4, ["--pp", "2", "--cp", "2", "--expert-tp", "2", "--schedule", "1f1b", "--zero", "3"],
     ["--layers", "4", "--micro-batches", "4"]),
]


def layout_id(world, flags, model):
    return f"{world}-" + "-".join(f.replace("--", "") for f in flags + model)


@pytest.mark.parametrize("world,flags,model", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_folded_layouts_match_single_device_and_the_plan(tmp_path, world, flags, model):
    argv = [*BASE, *model, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*BASE, *model]))
    assert_matches_plan(tmp_path, argv, world)


# -- Qwen's mixtures of experts: an expert's own width, dense layers between, gates as the softmax gave them,
# and Qwen2-MoE's shared expert of its own width behind a sigmoid gate --------------------------------------
# No flag sets these (a Hugging Face folder does: test_hf.py), so the flags' model gets them here, in the
# workers and in this process (the single device's run and the plan).

QWEN_MOE = dict(moe_layers=(0, 2), d_expert=48, n_shared_experts=1, d_shared=40, shared_expert_gate=True,
                norm_topk_prob=False)
FLAGS_MODEL = cli.model_config


def qwen_moe_config(args, vocab_size):
    return dataclasses.replace(FLAGS_MODEL(args, vocab_size), **QWEN_MOE)


def qwen_moe_train_worker(argv):
    cli.model_config = qwen_moe_config
    return train_worker(argv)


# (ranks, flags, model flags): the gate's gradient whole on every tp rank without sp, summed over them with
# it; experts split by --expert-tp at their own width; a pipeline whose stages hold an MoE and a dense layer
# each, under ZeRO-3. Top-4 of 4 experts (balanced by construction) where the plan's counters are exact.
QWEN_LAYOUTS = [
    (2, ["--tp", "2", "--ep", "2"], ["--arch", "llama"]),
    (2, ["--tp", "2", "--sp", "--ep", "2"], ["--arch", "llama", "--top-k", "4"]),
    (2, ["--tp", "2", "--expert-tp", "2"], []),
    (4, ["--pp", "2", "--ep", "2", "--zero", "3"], ["--arch", "llama", "--micro-batches", "4"]),
]


@pytest.mark.parametrize("world,flags,model", QWEN_LAYOUTS, ids=[layout_id(*layout) for layout in QWEN_LAYOUTS])
def test_qwen_moe_layouts_match_single_device_and_the_plan(tmp_path, monkeypatch, world, flags, model):
    argv = [*BASE, "--layers", "4", *model, *flags]
    monkeypatch.setattr(cli, "model_config", qwen_moe_config)
    expected = reference_run([*BASE, "--layers", "4", *model])
    for result in run_on_ranks(world, qwen_moe_train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, expected)
    assert_matches_plan(tmp_path, argv, world)


def test_qwen_moe_recomputed_in_bfloat16_equals_the_plan(tmp_path, monkeypatch):
    """Every counter, activations exactly (top-4 of 4): the gate's sigmoid and the output it scales, kept
    again by the recomputed forward, in bfloat16 with the router in float32."""
    argv = [*BASE, "--layers", "4", "--arch", "llama", "--top-k", "4", "--tp", "2", "--sp", "--ep", "2",
            "--recompute", "full", "--dtype", "bfloat16"]
    monkeypatch.setattr(cli, "model_config", qwen_moe_config)
    run_on_ranks(2, qwen_moe_train_worker, [*argv, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, argv, 2)


@pytest.mark.parametrize("widths,flags,message", [
    (dict(d_expert=47), ["--tp", "2", "--expert-tp", "2"], "--expert-tp 2: an expert's hidden size 47 does not"),
    (dict(n_shared_experts=1, d_shared=41), ["--tp", "2", "--ep", "2"],
     "--tp 2: the shared expert's hidden size 41 does not"),
])
def test_expert_widths_that_do_not_split_are_refused(monkeypatch, widths, flags, message):
    """Checked against the experts' own widths, not the dense layers' d_ff (128 here, which would split)."""
    monkeypatch.setattr(cli, "model_config", lambda args, vocab: dataclasses.replace(FLAGS_MODEL(args, vocab), **widths))
    with pytest.raises(cli.ConfigError, match=message):
        cli.check_args(cli.parse_args([*BASE, *flags]), 2)


# -- a checkpoint from the unfolded layout, resumed folded -----------------------------------------------

def test_checkpoint_from_the_unfolded_layout_resumes_exactly_folded(tmp_path):
    """Saved where ep spans data-parallel ranks and the experts are split as tp splits the dense layers (the
    layout before folding: 4 ranks, --expert-tp = --tp), resumed on 2 ranks with ep over tp and whole
    experts, and back."""
    argv = [*BASE, "--steps", "4", "--tp", "2", "--ep", "2"]
    unfolded, folded = (4, ["--expert-tp", "2"]), (2, [])
    for first, second, name in [(unfolded, folded, "there"), (folded, unfolded, "back")]:
        (world_a, flags_a), (world_b, flags_b) = first, second
        out = tmp_path / name
        a = run_on_ranks(world_a, train_worker, [*argv, *flags_a, "--stop-at", "2", "--out", str(out / "a")])[0]
        (run,) = (out / "a").iterdir()
        b = run_on_ranks(world_b, train_worker, [*argv, *flags_b, "--resume", str(run / "checkpoint-00000002"),
                                                 "--out", str(out / "b")], timeout=300)[0]
        assert_matches_oracle(dict(losses=a["losses"] + b["losses"], state_dict=b["state_dict"]),
                              reference_run(argv))


# -- one layer: the capacity limit on the tokens each rank routes, expert tensor parallelism ------------

D, TOKENS, E = 8, 12, 4


def folded_layer_worker(capacity_factor, expert_tp):
    """4 ranks as dp=2, tp=2 (the tp pairs hold the same tokens, each routes half of them), ep=4/expert_tp,
    against model.py's MoE applying the capacity rule to each rank's half on one device."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    tp_group = pairs[rank // 2]
    ep_groups = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])] if expert_tp == 2 else [dist.new_group()]
    ep_group = ep_groups[rank % 2] if expert_tp == 2 else ep_groups[0]
    torch.manual_seed(0)
    config = GPTConfig(d_model=D, n_head=2, n_layer=1, d_ff=2 * D, vocab_size=16, seq_len=TOKENS, n_experts=E,
                       top_k=2, n_shared_experts=1, bias=True)
    reference = MoE(config).to(torch.float64)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer = ep.ExpertParallelMoE(copy.deepcopy(reference), ep_group, None, capacity_factor=capacity_factor,
                                 tokens=ep.ReplicatedTokens(tp_group),
                                 expert_tp=ep.SplitExperts(pairs[rank // 2]) if expert_tp == 2 else ep.WholeExperts())
    tp.split_moe(layer, tp.TensorParallel(tp_group))
    if expert_tp == 2:
        tp.split_experts(layer, pairs[rank // 2])
    g = torch.Generator().manual_seed(1)
    data = torch.randn(n // 2, TOKENS, D, generator=g, dtype=torch.float64)
    tokens, same_tokens = (data[rank // 2].clone().requires_grad_() for _ in range(2))
    out = layer(tokens)
    expected, dropped = torch.zeros_like(tokens), 0
    for start, rows in [(0, TOKENS // 2), (TOKENS // 2, TOKENS // 2)]:  # each tp rank's half, on its own
        chunk = same_tokens[start:start + rows]
        gates, experts, _ = ep.route(reference.router(chunk), 2)
        keep = (ep.capacity_mask(experts, E, int(capacity_factor * rows * 2 / E + 0.999999)) if capacity_factor
                else torch.ones_like(experts, dtype=torch.bool))
        dropped += int((~keep).sum())
        for t in range(rows):
            for choice in range(2):
                if keep[t, choice]:
                    e = experts[t, choice].item()
                    expected[start + t] += gates[t, choice] * reference.experts[e](chunk[t])
    expected = expected + reference.shared(same_tokens)
    # backward: the tokens' gradient, whole on every rank of the pair (each routed half's and the shared expert's
    # parts summed over tp), for a loss weighing each output differently
    weights = torch.randn(TOKENS, D, generator=g, dtype=torch.float64)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    worst = max((out - expected).abs().max().item(), (tokens.grad - same_tokens.grad).abs().max().item())
    return worst, layer.dropped, dropped


@pytest.mark.parametrize("capacity_factor,expert_tp", [(0.75, 1), (0.75, 2), (0.0, 2)])
def test_one_layer_routes_each_token_once_under_tp(capacity_factor, expert_tp):
    """Each rank's output, and its tokens' gradient, equal the rule applied to each half alone (so each token
    was routed once, on one rank); the dropped tokens logged are those of both data ranks' halves."""
    results = run_on_ranks(4, folded_layer_worker, capacity_factor, expert_tp)
    dropped = results[0][2] + results[2][2]  # ranks 0 and 2 hold the two data ranks' tokens
    for worst, logged, _ in results:
        assert worst < 1e-12
        assert logged == dropped
    assert (dropped > 0) == (capacity_factor > 0)


def gated_shared_expert_worker(sequence_parallel):
    """2 ranks, tp = ep = 2, as train.py folds them: Qwen2-MoE's layer (experts of their own width, gates not
    renormalised, a shared expert of its own width behind a sigmoid gate) against model.py's on one device.
    The gate multiplies the shared expert's output after its row-parallel g: without sp every rank computes it
    for the same tokens with the same output gradient (its gradient whole, not summed), with sp for its
    sequence shard (a partial sum, summed over tp)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    config = GPTConfig(d_model=D, n_head=2, n_layer=1, d_ff=2 * D, vocab_size=16, seq_len=TOKENS, n_experts=E,
                       top_k=2, d_expert=6, n_shared_experts=1, d_shared=10, shared_expert_gate=True,
                       norm_topk_prob=False)
    torch.manual_seed(0)
    reference = MoE(config).to(torch.float64)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    tokens = ep.ShardedTokens(group) if sequence_parallel else ep.ReplicatedTokens(group)
    layer = ep.ExpertParallelMoE(copy.deepcopy(reference), group, group, tokens=tokens)
    tp.split_moe(layer, tp.SequenceParallel(group) if sequence_parallel else tp.TensorParallel(group))
    g = torch.Generator().manual_seed(1)
    data, weights = (torch.randn(1, TOKENS, D, generator=g, dtype=torch.float64) for _ in range(2))
    mine = (lambda t: t.chunk(n, 1)[rank]) if sequence_parallel else (lambda t: t)  # this rank's tokens
    x, whole = mine(data).clone().requires_grad_(), data.clone().requires_grad_()
    out, expected = layer(x), reference(whole)
    (out * mine(weights)).sum().backward()  # without sp every rank's loss is the whole one
    (expected * weights).sum().backward()
    errors = {"output": (out - mine(expected)).abs().max().item(),
              "input's gradient": (x.grad - mine(whole.grad)).abs().max().item()}
    layouts = tp.sharded_layouts(layer)
    for name, p in layer.named_parameters():
        full = reference.get_parameter(name).grad
        dim, blocks = layouts.get(name, (None, None))
        errors[name] = (p.grad - (full if dim is None else tp.shard(full, dim, rank, n, blocks))).abs().max().item()
    return errors


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_shared_expert_gate_gradient_is_summed_over_tp_only_under_sp(sequence_parallel):
    for errors in run_on_ranks(2, gated_shared_expert_worker, sequence_parallel):
        assert "shared_gate.weight" in errors
        assert max(errors.values()) < 1e-12, errors
