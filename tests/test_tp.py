"""Tensor parallelism (with and without sequence parallelism) equals the single device."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp
from distributed import run_on_ranks, self_check_alone
from training.meter import ActivationMeter
from model import Block, GPTConfig
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan

ARGV = EQUIVALENCE
# Qwen3's attention on the tiny preset: 4 heads of 12 (q is 48 wide over d_model 32), 2 key/value heads, QK-norm
QWEN3 = ["--arch", "llama", "--heads", "4", "--kv-heads", "2", "--head-dim", "12", "--qk-norm"]


@pytest.mark.parametrize("world,flags,model", [
    (2, ["--tp", "2"], []), (2, ["--tp", "2", "--sp"], []), (4, ["--tp", "4"], []), (4, ["--tp", "4", "--sp"], []),
    (4, ["--tp", "2"], []),  # tp=2 x dp=2
    (2, ["--tp", "2"], QWEN3),  # QK-norm's weights summed over the heads of both ranks (with sp: test_cp.py)
], ids=lambda v: v if isinstance(v, int) else " ".join(v) or "tiny")
def test_tensor_parallel_matches_single_device(tmp_path, world, flags, model):
    argv = [*ARGV, *model, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)]):
        assert_matches_oracle(result, oracle([*ARGV, *model]))
    assert_matches_plan(tmp_path, argv, world)


# -- each layer against its single-device counterpart -------------------------

def max_diff(a, b):
    return (a - b).abs().max().item()


def plan(sp):
    return tp.SequenceParallel(None) if sp else tp.TensorParallel(None)


def check_linear(kind, sp, rank, n):
    """Output, input gradient and gathered weight/bias gradients of a parallel linear against nn.Linear."""
    d_in, d_out = (8, 12) if kind == "column" else (12, 8)
    full = torch.nn.Linear(d_in, d_out, dtype=torch.float64)
    layer_class = tp.ColumnParallelLinear if kind == "column" else tp.RowParallelLinear
    layer = layer_class(copy.deepcopy(full), plan(sp))
    x = torch.randn(3, 4, d_in, dtype=torch.float64, requires_grad=True)  # (batch, seq, features)
    grad_y = torch.randn(3, 4, d_out, dtype=torch.float64)
    (full(x) * grad_y).sum().backward()
    # What this rank sees: column layers take the full input (sp: a sequence shard) and give some output
    # features; row layers take some input features and give the full output (sp: a sequence shard).
    seq = lambda t: t.chunk(n, 1)[rank] if sp else t  # noqa: E731
    feat = lambda t: t.chunk(n, -1)[rank]  # noqa: E731
    x_local = (seq(x) if kind == "column" else feat(x)).detach().requires_grad_()
    y_local = layer(x_local)
    (y_local * (feat(grad_y) if kind == "column" else seq(grad_y))).sum().backward()
    unseq = lambda t: tp.unshard(t, 1, None) if sp else t  # noqa: E731
    unfeat = lambda t: tp.unshard(t, -1, None)  # noqa: E731
    y = unfeat(y_local) if kind == "column" else unseq(y_local)
    grad_x = unseq(x_local.grad) if kind == "column" else unfeat(x_local.grad)
    errors = [max_diff(y, full(x)), max_diff(grad_x, x.grad)]
    for name, p in layer.named_parameters():
        grad = tp.unshard(p.grad, layer.layouts[name][0], None) if name in layer.layouts else p.grad
        errors.append(max_diff(grad, getattr(full, name).grad))
    return max(errors)


def check_embedding(sp, rank, n):
    full = torch.nn.Embedding(16, 8, dtype=torch.float64)
    layer = tp.VocabParallelEmbedding(copy.deepcopy(full), plan(sp))
    ids = torch.randint(0, 16, (3, 4))
    grad_y = torch.randn(3, 4, 8, dtype=torch.float64)
    (full(ids) * grad_y).sum().backward()
    y_local = layer(ids)
    (y_local * (grad_y.chunk(n, 1)[rank] if sp else grad_y)).sum().backward()
    y = tp.unshard(y_local, 1, None) if sp else y_local
    return max(max_diff(y, full(ids)), max_diff(tp.unshard(layer.weight.grad, 0, None), full.weight.grad))


def check_cross_entropy(rank, n):
    logits = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 16, (3, 4))
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    expected.backward()
    local = logits.detach().chunk(n, -1)[rank].clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(local, targets, rank * 16 // n, None)
    loss.backward()
    return max(max_diff(loss, expected), max_diff(tp.unshard(local.grad, -1, None), logits.grad))


def layers_worker():
    """Largest difference of each parallel layer from its single-device counterpart, float64."""
    torch.manual_seed(0)
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = {"cross-entropy": check_cross_entropy(rank, n)}
    for sp in (False, True):
        errors[f"column sp={sp}"] = check_linear("column", sp, rank, n)
        errors[f"row sp={sp}"] = check_linear("row", sp, rank, n)
        errors[f"embedding sp={sp}"] = check_embedding(sp, rank, n)
    return errors


@pytest.fixture(scope="module")
def layer_errors():
    return run_on_ranks(2, layers_worker)


@pytest.mark.parametrize("layer", ["column sp=False", "column sp=True", "row sp=False", "row sp=True",
                                   "embedding sp=False", "embedding sp=True", "cross-entropy"])
def test_each_layer_matches_its_single_device_counterpart(layer_errors, layer):
    for errors in layer_errors:
        assert errors[layer] < 1e-14


# -- communication and activation memory of one block ------------------------------------

LLAMA = dict(n_kv_heads=2, position="rope", norm="rms", mlp="swiglu", bias=False, d_ff=48)


def block_worker(sequence_parallel, arch):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=16, **arch)
    block = Block(config, 0).double()
    tp.split_block(block, config, plan(sequence_parallel))
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    if sequence_parallel:
        x = x.chunk(dist.get_world_size(), 1)[dist.get_rank()].clone()  # only this rank's shard exists
    x.requires_grad_()
    meter = ActivationMeter(list(block.parameters()))
    tp.comm_bytes.clear()
    with meter:
        y = block(x, torch.arange(8))
    forward = dict(tp.comm_bytes)
    tp.comm_bytes.clear()
    y.sum().backward()
    return forward, dict(tp.comm_bytes), meter.peak


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt", "llama"])
def test_block_communication_and_activation_memory(arch):
    n, b, s, h = 2, 2, 8, 16
    activation = b * s * h * 8  # bytes of one (batch, seq, hidden) float64 tensor
    ring = (n - 1) / n
    plain = run_on_ranks(2, block_worker, False, arch)[0]
    seq_par = run_on_ranks(2, block_worker, True, arch)[0]
    # Without sequence parallelism: two all-reduces of b*s*h in forward (g after attention and after the MLP)
    # and two in backward (f before qkv and before fc); an all-reduce sends 2 (N-1)/N of its data. The same
    # with grouped-query attention and SwiGLU: q, k, v and gate, up are each one fused column-parallel layer.
    assert plain[0] == {"all_reduce": 2 * 2 * ring * activation}
    assert plain[1] == {"all_reduce": 2 * 2 * ring * activation}
    # With it: the same volume as all-gathers and reduce-scatters, plus the summed gradients of the
    # replicated vectors applied to sequence shards: GPT-2's two layer norms' weight and bias and two row
    # biases (six), Llama's two RMSNorm weights (two; no biases).
    vectors = 2 if arch else 6
    assert seq_par[0] == {"all_gather": 2 * ring * activation, "reduce_scatter": 2 * ring * activation}
    assert seq_par[1] == {"all_gather": 2 * ring * activation, "reduce_scatter": 2 * ring * activation,
                          "all_reduce": vectors * 2 * ring * h * 8}
    # Activation memory: what the two norms save is now kept for 1/N of the sequence; the matmuls save what
    # they did before. A layer norm saves its input, a mean and a reciprocal standard deviation per token;
    # what an RMSNorm saves depends on PyTorch's kernel (on CPU in 2.13: its input, the normalised input and
    # a reciprocal root mean square per token), so it is measured on one norm alone.
    assert plain[2] - seq_par[2] == 2 * saved_by_one_norm(arch, (b, s, h)) * (1 - 1 / n)
    if not arch:
        assert saved_by_one_norm(arch, (b, s, h)) == activation + 2 * b * s * 8


def saved_by_one_norm(arch, shape):
    norm = Block(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=16, **arch), 0).norm1.double()
    meter = ActivationMeter(list(norm.parameters()))
    with meter:
        norm(torch.randn(shape, dtype=torch.float64, requires_grad=True))
    return meter.peak


# -- QK-norm: one weight for every head, so a partial sum on each rank -----------------------------

def qk_norm_block_worker():
    """A block with QK-norm and heads wider than d_model / n_head, split over the group without and with
    sequence parallelism: the largest difference of its output and of every gradient from the block on one
    process (float64), per parameter."""
    torch.manual_seed(0)
    rank, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=16, head_dim=6, qk_norm=True, **LLAMA)
    block = Block(config, 0).double()
    with torch.no_grad():  # weights of their own, so that each head's share of their gradient differs
        for norm in (block.attn.q_norm, block.attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    x, grad_y = (torch.randn(2, 8, 16, dtype=torch.float64) for _ in range(2))
    y = block(x, torch.arange(8))
    (y * grad_y).sum().backward()
    errors = {}
    for sp in (False, True):
        split = copy.deepcopy(block)
        split.zero_grad(set_to_none=True)
        tp.split_block(split, config, plan(sp))
        mine = (lambda t: t.chunk(n, 1)[rank]) if sp else (lambda t: t)  # noqa: E731 (sp: this rank's shard)
        y_local = split(mine(x), torch.arange(8))
        (y_local * mine(grad_y)).sum().backward()
        layouts = tp.sharded_layouts(split)
        errors[f"output sp={sp}"] = max_diff(y_local, mine(y))
        for name, p in split.named_parameters():
            grad = tp.unshard(p.grad, layouts[name][0], None, layouts[name][1]) if name in layouts else p.grad
            errors[f"{name} sp={sp}"] = max_diff(grad, dict(block.named_parameters())[name].grad)
    return errors


def test_qk_norm_gradients_are_summed_over_the_group_with_and_without_sp():
    """Each rank normalises its own heads' q and k with the one weight every head shares: its gradient there is a
    partial sum (Megatron Core #7452, finding 11: such a weight summed only under sequence parallelism), which
    tp.split_attention sums over the group. Left out, q_norm's and k_norm's gradients are each rank's heads'
    alone, and this fails."""
    for errors in run_on_ranks(2, qk_norm_block_worker):
        assert {name for name in errors if "q_norm" in name or "k_norm" in name} == \
            {f"attn.{norm}.weight sp={sp}" for norm in ("q_norm", "k_norm") for sp in (False, True)}
        assert max(errors.values()) < 1e-13, errors


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("tp.py", 2, tmp_path)  # sequence parallelism off and on
    assert len(differences) == 2 and max(differences) < 1e-12
