"""--fp8 (training/fp8.py): the float8 linear's three products against a reference written out here, and
training under every layout equal to one process's FP8 training: rowwise exactly (the maxima reduced over
the groups that split them; left local, the layouts part), tensorwise exactly where only tp splits its
tensors and within its stated distance where data parallelism splits the tokens its maxima span."""
import dataclasses

import pytest
import torch

from distributed import run_on_ranks
from model import GPT
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from training import cli, fp8
from training.checkpoint import Checkpoint

E4M3_TOP, E5M2_TOP = 448.0, 57344.0


def dequantised(t, over, top, dtype):
    """t through float8 and back, written out: each maximum of |t| over the dims `over` (None: all) sets a scale,
    the least power of two s with max/s <= top (from frexp: max/top = m 2^e, m in [0.5, 1): s = 2^e, or 2^(e-1)
    where m is one half); a maximum of 0, s = 1."""
    largest = t.abs().amax() if over is None else t.abs().amax(dim=over, keepdim=True)
    mantissa, exponent = torch.frexp(largest / top)
    scale = torch.where(largest == 0, 1.0, torch.exp2(exponent - (mantissa == 0.5).long()).double())
    return (t / scale).clamp(-top, top).to(dtype).double() * scale


def operands():
    """x (6, 48) with a row of zeros and values far past e4m3's 448; W (32, 48) with a zero row; dY (6, 32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 48, dtype=torch.float64, generator=g) * 3
    x[2] = 0
    x[4, :5] = torch.tensor([1e4, -3e3, 700.0, 1e-3, -1e-6])
    weight = torch.randn(32, 48, dtype=torch.float64, generator=g) * 0.1
    weight[7] = 0
    weight[3, 0] = 900.0
    grad = torch.randn(6, 32, dtype=torch.float64, generator=g) * 1e-3
    return x, weight, grad


def reference(recipe, x, weight, grad):
    """(y, dX, dW) of the recipe, each product of dequantised operands in float64."""
    e4 = torch.float8_e4m3fn
    if recipe == "rowwise":  # rows along the summed dimension; dW = dYᵀ x unquantised
        y = dequantised(x, -1, E4M3_TOP, e4) @ dequantised(weight, -1, E4M3_TOP, e4).t()
        grad_x = dequantised(grad, -1, E4M3_TOP, e4) @ dequantised(weight, 0, E4M3_TOP, e4)
        return y, grad_x, grad.t() @ x
    grad8 = dequantised(grad, None, E5M2_TOP, torch.float8_e5m2)
    x8, weight8 = dequantised(x, None, E4M3_TOP, e4), dequantised(weight, None, E4M3_TOP, e4)
    return x8 @ weight8.t(), grad8 @ weight8, grad8.t() @ x8


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_the_float8_products_equal_the_reference_written_out(recipe, dtype):
    """float64: the float8 products summed in float64, to its rounding. float32: summed in float32 (written out on
    a CPU, whichever kernels the release's torch._scaled_mm has there; _scaled_mm on a GPU, test_cuda.py), whose float32
    sums of 48 exact products may differ from float64's by 48 float32 roundings of the largest partial sum
    (2^-24 relative each), so to 2^-17 of the output's largest magnitude."""
    x, weight, grad = operands()
    leaves = [t.to(dtype).requires_grad_() for t in (x, weight)]
    y = fp8.float8_linear(*leaves, None, fp8.RECIPES[recipe], fp8.Split())
    y.backward(grad.to(dtype))
    expected = reference(recipe, x, weight, grad)
    if recipe == "rowwise" or dtype == torch.float64:  # (a check of the reference too: it is not the plain product)
        assert (expected[0] - x @ weight.t()).abs().max() > 1e-3 * (x @ weight.t()).abs().max()
    for got, want in zip((y, leaves[0].grad, leaves[1].grad), expected):
        assert got.dtype == dtype
        rounding = 1e-13 if dtype == torch.float64 else 2**-17
        torch.testing.assert_close(got.double(), want, rtol=0, atol=rounding * want.abs().max().item())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_an_expert_that_receives_no_token_computes_nothing(recipe):
    weight = torch.randn(32, 48, dtype=torch.float64, requires_grad=True)
    y = fp8.float8_linear(torch.zeros(0, 48, dtype=torch.float64), weight, None, fp8.RECIPES[recipe], fp8.Split())
    y.sum().backward()
    assert y.shape == (0, 32) and not weight.grad.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_product_without_bias_may_be_written_in_place_as_a_shared_experts_output_is(recipe, dtype):
    """model.py's MoE adds the routed experts' outputs into the shared expert's with index_add_: a float8
    product's output is a tensor autograd lets one write into, with the gradients of writing into a copy."""
    x, weight, grad = operands()
    rows, added = torch.tensor([0, 3, 3]), torch.randn(3, 32, dtype=torch.float64)
    gradients = []
    for written_in in (lambda y: y, torch.clone):
        leaves = [t.to(dtype).requires_grad_() for t in (x, weight)]
        y = written_in(fp8.float8_linear(*leaves, None, fp8.RECIPES[recipe], fp8.Split()))
        y.index_add_(0, rows, added.to(dtype))
        y.backward(grad.to(dtype))
        gradients.append([y.detach(), *(leaf.grad for leaf in leaves)])
    for in_place, copied in zip(*gradients):
        torch.testing.assert_close(in_place, copied, rtol=0, atol=0)


def test_every_block_matrix_but_routers_and_gates_computes_in_float8():
    config = cli.model_config(cli.parse_args([*EQUIVALENCE, "--experts", "4", "--shared-experts", "1"]), 64)
    config = dataclasses.replace(config, shared_expert_gate=True, moe_layers=(1,))  # (Qwen2-MoE's gate)
    model = fp8.apply_fp8(GPT(config), "rowwise")
    in_float8 = {name for name, m in model.named_modules() if isinstance(m, fp8.Float8Linear)}
    plain = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert {"blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.mlp.experts.3.proj", "blocks.1.mlp.shared.fc"} <= in_float8
    assert plain == {"lm_head", "blocks.1.mlp.router", "blocks.1.mlp.shared_gate"}


ROWWISE = [*EQUIVALENCE, "--fp8", "rowwise"]
LLAMA, DEEP, MOE = ["--arch", "llama", "--kv-heads", "2"], ["--layers", "4"], ["--experts", "4", "--top-k", "2"]

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    (2, LLAMA, ["--tp", "2", "--sp"]),
    (2, DEEP, ["--pp", "2", "--schedule", "1f1b"]),
    (2, [*LLAMA, *DEEP, "--micro-batches", "4"], ["--pp", "2", "--schedule", "zbv"]),
    (2, [], ["--cp", "2", "--cp-mode", "ring"]),
    (2, LLAMA, ["--cp", "2", "--cp-mode", "allgather"]),
    (2, LLAMA, ["--cp", "2", "--cp-mode", "alltoall"]),
    (2, [*LLAMA, *MOE], ["--tp", "2", "--sp", "--ep", "2"]),  # experts whole, folded over tp: nothing reduced
    (4, [*MOE, "--shared-experts", "1"], ["--tp", "2", "--ep", "2", "--expert-tp", "2", "--recompute", "full"]),
    (2, [*LLAMA, *MOE, "--shared-experts", "1"], ["--ep", "2"]),  # one device's shared expert: no bias, in place
    (2, LLAMA, ["--zero", "3"]),
    (4, ["--optimizer", "muon"], ["--tp", "2", "--zero", "2", "--dp-shard", "1"]),  # hybrid: 2 copies of the shards
    (8, [*LLAMA, *DEEP, *MOE], ["--tp", "2", "--sp", "--pp", "2", "--cp", "2", "--ep", "2", "--zero", "1"]),
]


def layout_id(world, model, flags):
    return f"{world}-" + "-".join(f.lstrip("-") for f in flags + model)


# Rowwise: the layouts' float8 operands are the one process's, element for element; their products are summed
# in float64 in another order (a float64 run's, training/fp8.py), so the oracle's 1e-9 holds: 10^7 times below
# e4m3's rounding step (2^-4 relative). One element across a rounding boundary moves the loss by ~1e-3.
@pytest.mark.full
@pytest.mark.parametrize("world,model,flags", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_rowwise_training_equals_one_process_under_every_layout(tmp_path, world, model, flags):
    argv = [*ROWWISE, *model, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*ROWWISE, *model]))
    assert_matches_plan(tmp_path, argv, world)


def local_maxima_worker(argv):
    """train_worker with every rank's maxima its own (no reduction over the group)."""
    reduced = fp8.maxima
    fp8.maxima = lambda t, group, whole=False: reduced(t, None, whole)
    return train_worker(argv)


def rowwise_tp2(tmp_path, worker):
    argv = [*ROWWISE, *LLAMA, "--tp", "2", "--out", str(tmp_path)]
    return run_on_ranks(2, worker, argv, timeout=300)[0]


def test_rowwise_tp2_equals_one_process_with_the_maxima_reduced_and_not_with_its_own(tmp_path):
    """The row-parallel layers' input rows and weight rows, the column-parallel ones' gradient rows and weight
    columns, span the tp group: their maxima over the group are the one process's; a rank's own quantise its
    slice more finely, and the run parts from one process by float8 roundings."""
    reduced, local = rowwise_tp2(tmp_path / "a", train_worker), rowwise_tp2(tmp_path / "b", local_maxima_worker)
    one_process = oracle([*ROWWISE, *LLAMA])
    assert_matches_oracle(reduced, one_process)
    assert largest_difference(local, one_process) > 1e3 * 1e-9  # (measured: 3e-6 of a parameter's largest value)


def largest_difference(run, one_process):
    """The largest difference of a final parameter from one process's, relative to that parameter's largest value."""
    return max(((run["state_dict"][name] - p).abs().max() / p.abs().max()).item()
               for name, p in one_process["state_dict"].items())


TENSORWISE = [*EQUIVALENCE, "--fp8", "tensorwise"]


def test_tensorwise_equals_one_process_under_tp_and_within_its_distance_under_dp(tmp_path):
    """Under tp2 every tensor's maximum is reduced over the group splitting it: one process's, exactly. Under dp2
    each rank's activations' and gradients' maxima are those of its half of the tokens: a scale a power of two
    smaller quantises them more finely, each element moving by at most half a float8 step (2^-4 of itself
    in e4m3, 2^-3 in e5m2), so losses stay within 2^-4 of one process's (measured: 4e-11: with scales powers of
    two, a half's maximum mostly shares the whole's binade), and the parameters part by more than the oracle's
    tolerance (measured: 1e-7)."""
    tp2 = run_on_ranks(2, train_worker, [*TENSORWISE, "--tp", "2", "--out", str(tmp_path / "tp")], timeout=300)[0]
    dp2 = run_on_ranks(2, train_worker, [*TENSORWISE, "--out", str(tmp_path / "dp")], timeout=300)[0]
    one_process = oracle(TENSORWISE)
    assert_matches_oracle(tp2, one_process)
    assert max(abs(a - b) / b for a, b in zip(dp2["losses"], one_process["losses"])) < 2**-4
    assert largest_difference(dp2, one_process) > 1e2 * 1e-9
    assert_matches_plan(tmp_path / "tp", [*TENSORWISE, "--tp", "2"], 2)


def test_a_checkpoint_saved_with_fp8_resumes_without_it_and_back(tmp_path):
    """FP8 keeps no state: its checkpoint holds the tensors a plain run's does; resumed with --fp8 the run goes on
    exactly (one process's FP8 run), resumed without it the same weights train in the run's dtype (other losses),
    and that run's checkpoint resumes with --fp8 again."""
    argv = [*ROWWISE, "--steps", "4", "--tp", "2"]
    plain_argv = [flag for flag in argv if flag not in ("--fp8", "rowwise")]
    run_dir = "gpu2_tp2_pp1_cp1_ep1"
    first = run_on_ranks(2, train_worker, [*argv, "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    saved = tmp_path / "a" / run_dir / "checkpoint-00000002"
    again = run_on_ranks(2, train_worker, [*argv, "--resume", str(saved), "--out", str(tmp_path / "b")])[0]
    assert_matches_oracle(dict(losses=first["losses"] + again["losses"], state_dict=again["state_dict"]),
                          oracle([*ROWWISE, "--steps", "4"]))
    plain = run_on_ranks(2, train_worker, [*plain_argv, "--resume", str(saved), "--stop-at", "3",
                                           "--out", str(tmp_path / "c")])[0]
    assert plain["losses"][0] != again["losses"][0] and abs(plain["losses"][0] - again["losses"][0]) < 1e-2
    plain_saved = tmp_path / "c" / run_dir / "checkpoint-00000003"
    back = run_on_ranks(2, train_worker, [*argv, "--resume", str(plain_saved), "--out", str(tmp_path / "d")])[0]
    assert len(back["losses"]) == 1
    run_on_ranks(2, train_worker, [*plain_argv, "--stop-at", "2", "--out", str(tmp_path / "e")])
    assert Checkpoint(saved).tensors == Checkpoint(tmp_path / "e" / run_dir / "checkpoint-00000002").tensors


def test_fp8_flag_is_refused_for_an_unknown_recipe():
    with pytest.raises(SystemExit):
        cli.parse_args([*EQUIVALENCE, "--fp8", "blockwise"])
