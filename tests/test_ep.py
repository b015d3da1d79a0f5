"""Expert parallelism equals the single-device mixture of experts."""
import copy

import pytest
import torch
import torch.distributed as dist

from training import cli
import ep
import train
from distributed import run_on_ranks, self_check_alone
from hf_models import make_folder
from model import MoE, GPTConfig
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker
from planned import assert_matches_plan

BASE = [*EQUIVALENCE, "--experts", "4"]

@pytest.mark.parametrize("world,ep_size,top_k,extra", [
    (2, 2, 2, []), (4, 4, 2, []), (4, 2, 2, []), (2, 2, 1, []), (2, 1, 2, []),
    (4, 2, 2, ["--tp", "2"]), (2, 1, 2, ["--tp", "2", "--sp"]),
], ids=["ep2", "ep4", "ep2-dp2", "ep2-top1", "dp2-experts-replicated", "ep2-tp2-experts-split", "tp2-sp-experts"])
def test_expert_parallel_matches_single_device(tmp_path, world, ep_size, top_k, extra):
    argv = [*BASE, "--top-k", str(top_k), "--ep", str(ep_size), *extra, "--out", str(tmp_path)]
    for result in run_on_ranks(world, train_worker, argv):
        assert_matches_oracle(result, oracle([*BASE, "--top-k", str(top_k)]))  # the loss includes the aux loss


# -- an expert that no token reaches on any rank --------------------------------------------------

STARVED = [*BASE, "--top-k", "2", "--weight-decay", "0.5"]


def build_with_a_starved_expert(config, seed, dtype, device):
    """train.py's model, with a routing bias that keeps every token away from expert 3 of each layer."""
    model = BUILD_MODEL(config, seed, dtype, device)
    for block in model.blocks:
        block.mlp.route_bias[3] = -10.0
    return model


class StarvedExpertValues(train.InitialValues):
    """The same routing bias for train.py's sharded construction: each rank's layers start with it."""

    def buffer(self, name, empty):
        values = super().buffer(name, empty)
        if name.endswith("route_bias"):
            values[3] = -10.0
        return values


def starved_train_worker(argv):
    train.InitialValues = StarvedExpertValues
    return train_worker(argv)


BUILD_MODEL = train.build_model


@pytest.mark.parametrize("world,flags", [(4, ["--ep", "2"]), (2, []), (4, ["--ep", "2", "--zero", "1"]),
                                         (4, ["--ep", "2", "--zero", "2"]), (4, ["--ep", "2", "--zero", "3"])],
                         ids=["dp2-ep2", "dp2-experts-replicated", "dp2-ep2-zero1", "dp2-ep2-zero2", "dp2-ep2-zero3"])
def test_an_expert_no_token_reaches_is_left_alone_as_on_one_device(tmp_path, monkeypatch, world, flags):
    """On one device its gradient is None, so AdamW skips it (no weight decay): every rank must agree
    that no rank used it (dp.py's used-mask) and leave it as it was too."""
    monkeypatch.setattr(train, "build_model", build_with_a_starved_expert)
    expected = reference_run(STARVED)
    initial = build_with_a_starved_expert(cli.model_config(cli.parse_args(STARVED), 64), 0, torch.float64, "cpu")
    for name, p in initial.named_parameters():
        if ".experts.3." in name:
            assert torch.equal(expected["state_dict"][name], p), name  # untouched on one device
        elif ".experts." in name:
            assert not torch.equal(expected["state_dict"][name], p), name  # the others train
    for result in run_on_ranks(world, starved_train_worker, [*STARVED, *flags, "--out", str(tmp_path)]):
        assert_matches_oracle(result, expected)


# -- one layer, with a skewed router ------------------------------------------------------------

D, E, TOKENS = 8, 4, 12


def skewed_moe():
    """A reference MoE whose router never picks experts 0 and 3 (their logit is -100 x feature 0 = -500)."""
    torch.manual_seed(0)
    moe = MoE(GPTConfig(d_model=D, n_head=1, d_ff=16, n_experts=E, top_k=2)).double()
    with torch.no_grad():
        moe.router.weight[[0, 3]] = 0.0
        moe.router.weight[[0, 3], 0] = -100.0
    return moe


def local_tokens(rank):
    x = torch.randn(2, TOKENS, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 5.0
    return x[rank]


def skewed_worker(chunks=0):
    """The expert-parallel layer (with chunks, the overlapped one) against one device's, and its traffic."""
    rank, n = dist.get_rank(), dist.get_world_size()
    reference = skewed_moe()
    layer = (ep.OverlappedExpertParallelMoE(copy.deepcopy(reference), None, None, chunks=chunks) if chunks
             else ep.ExpertParallelMoE(copy.deepcopy(reference), None, None))
    all_tokens = torch.stack([local_tokens(r) for r in range(n)])
    grad = torch.randn_like(all_tokens, generator=torch.Generator().manual_seed(2))
    expected = reference(all_tokens.flatten(0, 1))
    ((expected * grad.flatten(0, 1)).sum() + reference.aux_loss).backward()

    ep.comm_bytes.clear()
    out = layer(local_tokens(rank).requires_grad_())  # in a model the tokens need gradients too
    forward_bytes = ep.comm_bytes["all_to_all"]
    # Each rank's aux term is N times its share (see ep.py): dividing by N here plays data parallelism's mean.
    ((out * grad[rank]).sum() + layer.aux_loss / n).backward()
    backward_bytes = ep.comm_bytes["all_to_all"] - forward_bytes
    dist.all_reduce(layer.router.weight.grad)
    aux = layer.aux_loss.detach().clone()
    dist.all_reduce(aux)

    _, experts, _ = ep.route(reference.router(local_tokens(rank)), 2)
    owner = experts // (E // n)
    routed_away = (owner != rank).sum()  # assignments whose expert lives on another rank
    routed_here = routed_away.clone()  # with two ranks: the other rank's assignments to my experts
    dist.all_reduce(routed_here)
    routed_away, routed_here = routed_away.item(), routed_here.item() - routed_away.item()
    errors = [(out - expected.view(n, TOKENS, D)[rank]).abs().max().item(),
              abs(aux.item() / n - reference.aux_loss.item()),
              (layer.router.weight.grad - reference.router.weight.grad).abs().max().item()]
    for e, expert in layer.experts.items():
        for p, ref in zip(expert.parameters(), reference.experts[int(e)].parameters()):
            if ref.grad is None:  # an expert no token reached is not run: no gradient, as on one device
                errors.append(0.0 if p.grad is None else float("inf"))
            else:
                errors.append((p.grad - ref.grad).abs().max().item())
    return dict(worst=max(errors), tokens_per_expert=layer.tokens_per_expert, my_experts=sorted(layer.experts),
                forward_bytes=forward_bytes, backward_bytes=backward_bytes, routed_away=routed_away,
                routed_here=routed_here)


@pytest.mark.parametrize("chunks", [0, 3], ids=["exchanged-whole", "overlapped-in-3-chunks"])
def test_skewed_router_with_idle_experts_still_matches(chunks):
    """Whole or in chunks (the all-to-alls beside the experts, an idle expert and a chunk without rows for some
    experts among them), the layer's output, loss and gradients are one device's, its traffic the same."""
    results = run_on_ranks(2, skewed_worker, chunks)
    for rank, r in enumerate(results):
        assert r["worst"] < 1e-12
        assert r["tokens_per_expert"][0] == r["tokens_per_expert"][3] == 0  # rank 0 and rank 1 each own an idle one
        assert r["my_experts"] == [str(e) for e in range(rank * E // 2, (rank + 1) * E // 2)]  # E/ep experts each
        # All-to-all traffic, D float64 values a row: forward, this rank sends its tokens bound for the other
        # rank's experts (dispatch) and returns the other rank's tokens it computed (combine); backward sends
        # their gradients the other way, the same volume.
        expected = (r["routed_away"] + r["routed_here"]) * D * 8
        assert r["forward_bytes"] == r["backward_bytes"] == expected
        assert r["routed_away"] > 0


def capacity_worker(capacity_factor):
    """The expert-parallel layer with a capacity factor against the same rule applied on one device."""
    rank = dist.get_rank()
    reference = skewed_moe()
    layer = ep.ExpertParallelMoE(copy.deepcopy(reference), None, None, capacity_factor=capacity_factor)
    tokens = local_tokens(rank)
    out = layer(tokens)
    gates, experts, _ = ep.route(reference.router(tokens), 2)
    capacity = -(-int(capacity_factor * TOKENS * 2) // E) if capacity_factor * TOKENS * 2 % E == 0 else \
        int(capacity_factor * TOKENS * 2 / E) + 1
    expected, kept = torch.zeros_like(tokens), {e: 0 for e in range(E)}
    for t in range(TOKENS):  # first come, first served, in token order
        for choice in range(2):
            e = experts[t, choice].item()
            if kept[e] < capacity:
                kept[e] += 1
                expected[t] += gates[t, choice] * reference.experts[e](tokens[t])
    dropped_here = 2 * TOKENS - sum(kept.values())
    dropped = torch.tensor([dropped_here])
    dist.all_reduce(dropped)
    return (out - expected).abs().max().item(), layer.dropped, dropped.item()


def test_capacity_factor_drops_overflow_in_token_order():
    for worst, logged, expected_dropped in run_on_ranks(2, capacity_worker, 0.75):
        assert worst < 1e-12
        assert logged == expected_dropped > 0  # two busy experts share all tokens: some must be dropped


@pytest.mark.parametrize("flags,message", [
    (["--ep", "2", "--experts", "3"], "--experts 3 do not divide over --ep 2 ranks"),
    (["--ep", "2", "--experts", "0"], "--ep spreads the experts of MoE layers: it needs --experts"),
    (["--experts", "4", "--top-k", "5"], "--top-k 5 must be between 1 and --experts 4"),
])
def test_refused_expert_flags(flags, message):
    with pytest.raises(cli.ConfigError) as refusal:
        cli.check_args(cli.parse_args([*BASE, *flags]), 2)
    assert message in str(refusal.value)


def test_the_first_blocks_of_a_qwen_moe_folder_keep_their_sparse_layers(tmp_path):
    """--layers N with --init-from keeps a folder's first N blocks, each sparse or dense as it is there (Qwen2-MoE's
    decoder_sparse_step 2: blocks 1 and 3 sparse); with none of them sparse the model has no experts (an empty
    moe_layers would make every block an MoE)."""
    make_folder(tmp_path, "qwen2_moe")
    shapes = {}
    for layers in ([], ["--layers", "3"], ["--layers", "1"]):
        config, _ = cli.check_args(cli.parse_args([*EQUIVALENCE, "--init-from", str(tmp_path), *layers]), 1)
        shapes[config.n_layer] = (config.moe_layers, config.n_experts)
    assert shapes == {4: ((1, 3), 4), 3: ((1,), 4), 1: ((), 0)}


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("ep.py", 4, tmp_path)
    assert len(differences) == 1 and max(differences) < 1e-12


# -- the all-to-alls beside the experts' computation (--ep-overlap) -----------------------------

OVERLAPPED = [*BASE, "--top-k", "2"]
SHARED = ["--shared-experts", "1", "--arch", "llama"]
# (ranks, the experiment's flags (the oracle's too), the layout's): experts whole and split, folded over tp with
# and without sp, with a shared expert, recomputed, pipelined, under ZeRO-3
OVERLAP_LAYOUTS = [
    (2, [], ["--ep", "2"]),
    (4, ["--micro-batches", "1"], ["--ep", "4"]),
    (4, [], ["--ep", "2", "--tp", "2"]),
    (4, [], ["--ep", "2", "--tp", "2", "--sp", "--recompute", "full"]),
    (4, SHARED, ["--ep", "2", "--expert-tp", "2"]),
    (4, ["--micro-batches", "4", "--batch-size", "16"], ["--ep", "2", "--pp", "2", "--schedule", "1f1b"]),
    (4, [], ["--ep", "2", "--zero", "3", "--recompute", "selective"]),
]


@pytest.mark.full
@pytest.mark.parametrize("world,model_flags,flags", OVERLAP_LAYOUTS,
                         ids=["-".join(f.lstrip("-") for f in flags) for _, _, flags in OVERLAP_LAYOUTS])
def test_the_overlapped_exchange_trains_as_one_device(tmp_path, world, model_flags, flags):
    """Each layout with its all-to-alls in three chunks beside the experts: the losses and weights of one
    device, as without the overlap, and the counters of tools.plan (the same activations, the same bytes)."""
    argv = [*OVERLAPPED, *model_flags, *flags, "--ep-overlap", "3"]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*OVERLAPPED, *model_flags]))
    assert_matches_plan(tmp_path, argv, world)


def test_the_overlap_is_the_share_of_the_exchanges_time_not_spent_waiting():
    """Three exchanges in one trace (microseconds): the first in flight 0-100 and waited for 60-100, the second
    20-70, waited for 65-70 (inside both spans of the first), the third 200-250, waited for 240-250; interleaved,
    and a range of another name between them. The rank had an exchange in flight 150 and waited 50: unions,
    since a second exchange in flight, or a wait within a wait (a paired micro-batch's), takes no extra time."""
    from tools.bench.moe_overlap import overlapped_fraction
    events = [dict(ph="X", name="ep.dispatch c0 start", ts=0, dur=1),
              dict(ph="X", name="ep.dispatch c1 start", ts=20, dur=1), dict(ph="X", name="ep.experts", ts=30, dur=10),
              dict(ph="X", name="ep.dispatch c0 wait", ts=60, dur=40), dict(ph="X", name="ep.dispatch c1 wait", ts=65, dur=5),
              dict(ph="X", name="ep.combine c0 start", ts=200, dur=1), dict(ph="X", name="ep.combine c0 wait", ts=240, dur=10),
              dict(ph="i", name="ep.dispatch c1 wait", ts=1)]
    in_flight, waited = overlapped_fraction(events)
    assert (in_flight, waited) == pytest.approx((150e-6, 50e-6))


# -- a micro-batch's all-to-alls beside another's computation (--schedule combined) ----------------

# Every expert chosen by every token (top-k = experts): routing is balanced whatever the router says, so the
# activations are compared with the plan exactly, the peak between a pair's halves included.
PAIRED = [*BASE, "--top-k", "4", "--micro-batches", "4", "--batch-size", "16", "--schedule", "combined",
          "--ep-overlap", "1"]
# (ranks, the experiment's flags (the oracle's too), the layout's): one stage (no pipeline: the pairs alone),
# two and four stages, with a shared expert, recomputed fully and selectively, ep folded over tp with sp, ZeRO-3,
# the balance over the global batch, packed documents (whose ids a recomputed block keeps)
PACKED = ["--seq-len", "32", "--document-mask", "--eos-id", "16"]  # (the tiny preset's frequent id: ~12 tokens)
FULL = pytest.mark.full  # (the rest in the full tier)
PAIRED_LAYOUTS = [
    pytest.param(2, [], ["--ep", "2"], id="one-stage-ep2"),
    pytest.param(4, [], ["--ep", "2", "--tp", "2", "--sp", "--zero", "3"], id="one-stage-ep2-tp2-sp-zero3", marks=FULL),
    pytest.param(4, [], ["--ep", "2", "--pp", "2"], id="pp2-ep2"),
    pytest.param(4, ["--layers", "4"], ["--pp", "4"], id="pp4", marks=FULL),
    pytest.param(4, SHARED, ["--ep", "2", "--pp", "2", "--recompute", "full"], id="pp2-ep2-shared-recomputed"),
    pytest.param(4, [], ["--ep", "2", "--tp", "2", "--sp", "--pp", "2", "--recompute", "selective"],
                 id="pp2-ep2-tp2-sp-selective", marks=FULL),
    pytest.param(4, [], ["--ep", "2", "--pp", "2", "--zero", "3"], id="pp2-ep2-zero3", marks=FULL),
    pytest.param(4, ["--aux-loss-scope", "global"], ["--ep", "2", "--pp", "2"], id="pp2-ep2-global-balance",
                 marks=FULL),
    pytest.param(4, PACKED, ["--ep", "2", "--pp", "2", "--recompute", "full"], id="pp2-ep2-documents-recomputed",
                 marks=FULL),
]


@pytest.mark.parametrize("world,model_flags,flags", PAIRED_LAYOUTS)
def test_paired_micro_batches_train_as_one_device(tmp_path, world, model_flags, flags):
    """Combined 1F1B: each steady-state forward runs beside a backward, the two taking turns at every
    all-to-all; the losses and weights of one device, and the counters of tools.plan."""
    argv = [*PAIRED, *model_flags, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*BASE, "--top-k", "4", "--micro-batches", "4", "--batch-size", "16",
                                              *model_flags]))
    assert_matches_plan(tmp_path, argv, world)


# Routed by the router (top-2 of 4 experts), so a micro-batch's balance loss is its own: with every expert
# chosen (PAIRED's top-k 4) that loss is the same constant for every micro-batch and has no gradient, and a
# pair's halves reading each other's went unseen. Under full recomputation the backward half runs its MoE
# layers' forward again while the forward half waits at its turn: what each leaves on the layer (its loss, that
# it is a recomputation, its counts) must stay its own (pp.per_thread). Tokens per expert are uneven here, so
# the oracle alone is the reference.
RECOMPUTED_PAIRS = [*BASE, "--top-k", "2", "--batch-size", "8", "--layers", "4", "--arch", "llama",
                    "--schedule", "combined", "--ep-overlap", "1", "--recompute", "full"]


@pytest.mark.parametrize("world,stages,micro_batches", [
    pytest.param(4, 2, 2, id="pp2-m2", marks=FULL), pytest.param(4, 2, 4, id="pp2-m4"),
    pytest.param(8, 4, 2, id="pp4-m2", marks=FULL), pytest.param(8, 4, 4, id="pp4-m4", marks=FULL)])
def test_paired_micro_batches_recomputed_fully_train_as_one_device(tmp_path, world, stages, micro_batches):
    argv = [*RECOMPUTED_PAIRS, "--micro-batches", str(micro_batches), "--balance", "both"]
    layout = ["--pp", str(stages), "--ep", "2", "--out", str(tmp_path)]
    for result in run_on_ranks(world, train_worker, [*argv, *layout], timeout=300):
        assert_matches_oracle(result, oracle(argv))
