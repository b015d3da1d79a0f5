"""Mixed precision (train.Precision): bfloat16 weights, activations and messages; float32 master weights,
moments and gradient reduction. Its structure is proven exact with wider dtypes; bfloat16 itself trains
within a stated distance of one device and of float32, sends half of float32's bytes where it should, and
holds no per-micro-batch copy of a weight.

(With every dtype float64, the policy is the exact contract the rest of the suite checks, layout by layout.)
"""
import functools
import math
import tempfile

import pytest
import torch

from training import cli
from training import meter
import train
from dp import ring_bytes_sent
from distributed import run_on_ranks
from oracle import train_worker
from planned import assert_matches_plan, logged_records

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

# Two steps of the tiny model with two micro-batches: 8 data ranks x 2 micro-batches, 4 layers (two stages).
BASE = ["--model", "tiny", "--layers", "4", "--batch-size", "16", "--micro-batches", "2", "--lr", "1e-2",
        "--warmup", "1", "--grad-clip", "0.05", "--eval-interval", "1000", "--log-interval", "1000"]
MOE = ("--experts", "4", "--top-k", "2")
# The benchmark table's rows besides one rank (bench.CONFIGS): (ranks, flags, model flags).
TABLE = [
    (2, [], ()), (4, [], ()), (8, [], ()),
    (8, ["--tp", "2"], ()), (8, ["--pp", "2"], ()), (8, ["--cp", "2"], ()),
    (8, ["--ep", "4"], MOE), (8, ["--tp", "2", "--pp", "2", "--ep", "2"], MOE), (8, ["--tp", "2", "--cp", "2"], ()),
]


def row_name(world, flags):
    return f"gpu{world}_" + "_".join(flags[i][2:] + flags[i + 1] for i in range(0, len(flags), 2))


@functools.lru_cache
def one_rank(argv):
    """The same policy and model on one rank: its losses and final weights (computed once per session)."""
    with tempfile.TemporaryDirectory() as out:
        return run_on_ranks(1, train_worker, [*argv, "--out", out], timeout=300)[0]


# ---------------------------------------------------------------------------
# The structure, exact: float32 weights with float64 master weights, moments and reduction
# ---------------------------------------------------------------------------

STRUCTURE = [*BASE, "--steps", "2", "--dtype", "float32", "--master-dtype", "float64"]
# ZeRO keeps its master shards apart from the weights (dp.Shard), each stage its own way, experts too.
ZERO = [(2, ["--zero", "1"], ()), (2, ["--zero", "2"], ()), (2, ["--zero", "3"], ()),
        (4, ["--ep", "2", "--zero", "3"], MOE), (8, ["--tp", "2", "--pp", "2", "--ep", "2", "--zero", "1"], MOE)]


@pytest.mark.parametrize("world,flags,model", TABLE + ZERO, ids=[row_name(w, f) for w, f, _ in TABLE + ZERO])
def test_float32_weights_with_a_float64_master_equal_one_device_under_the_same_policy(tmp_path, world, flags, model):
    """Every layout keeps a float64 master copy beside float32 weights, as one device does, and updates them
    alike. The weights, activations and messages are float32, so the layouts differ from one device by
    float32's summation order (tp's partial sums, dp's averages, ring attention's blocks): relative 1e-6 on
    the losses. The final weights: AdamW moves every element by about lr m/sqrt(v), whatever its gradient's
    size, so an element whose gradient is nearly zero (q's biases: 1e-9, the difference of terms a
    million times larger) is moved by its summation-order noise: up to 1e-3 of lr (1e-5) seen over
    every row, and 1.05e-5 on one element of an expert's matrix where experts fold over tp (each tp rank
    routes half the tokens, so an expert's gradient adds its rows in another order): the bound is 2e-3
    of lr (2e-5), 500 times below a missing update. What it proves is the structure, which float64 alone does not exercise (there the master is
    the weights themselves): a master kept apart is filled, given every micro-batch's averaged gradient,
    stepped and copied back into the weights by every layout as by one device; a missing piece shows as a
    whole update (lr = 1e-2). Slips at rounding level are below float32's summation noise: the float64
    runs check the arithmetic.
    """
    argv = [*STRUCTURE, *model]
    result = run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=300)[0]
    reference = one_rank(tuple(argv))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=0)
    assert result["state_dict"]["lm_head.weight"].dtype == torch.float32
    for name, expected in reference["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][name], expected, rtol=0, atol=2e-5, msg=name)


# ---------------------------------------------------------------------------
# bfloat16 trains as one device does, and as float32 does, within bfloat16's rounding
# ---------------------------------------------------------------------------

TREND = [*BASE, "--steps", "16", "--lr", "3e-3"]
ARCHS = {"gpt": (), "llama": ("--arch", "llama"), "deepseek": ("--arch", "deepseek")}
# Each row runs GPT's block and a second one: Llama's, or DeepSeek-V3's where the row splits attention or
# routes experts (latent attention under tp and cp, its sigmoid router under ep), so that both are held to
# bfloat16's bounds without running every row three times.
SECOND = ("gpt", "llama or deepseek")


def row_arch(arch, flags, model):
    if arch != SECOND[1]:
        return arch
    return "deepseek" if {"--tp", "--cp", "--ep"} & set(flags) else "llama"


def model_flags(arch, flags, model):
    """The model of a row: the Llama block's key/value heads are the tiny preset's 2 where tp splits them, 1
    elsewhere (grouped-query attention at its narrowest), as in test_compose."""
    arch = row_arch(arch, flags, model)
    kv_heads = ("--kv-heads", "1") if arch == "llama" and "--tp" not in flags else ()
    return (*ARCHS[arch], *kv_heads, *model)


@pytest.mark.parametrize("arch", SECOND)
@pytest.mark.parametrize("world,flags,model", TABLE + ZERO, ids=[row_name(w, f) for w, f, _ in TABLE + ZERO])
def test_bfloat16_trains_within_its_rounding_of_one_device_and_of_float32(tmp_path, arch, world, flags, model):
    """16 steps in bfloat16 at train.py's default learning rate (the loss falls by 0.6 to 0.7): at every step
    within 0.005 of one device in bfloat16 and of float32 (dense), 0.02 with experts.

    bfloat16 keeps 8 bits of mantissa: every weight, activation and message is rounded by up to 2^-9
    relative, the residual stream too. Layouts round at different places (tp's partial sums are added in
    bfloat16, ring attention merges blocks, dp averages), yet stay closer to one device in bfloat16 (at
    most 0.0006 dense, measured over the table's rows and both blocks) than it is to float32 (0.0019).
    With experts a rounding flips near-tied routing choices, and a token sent to another expert changes
    its output wholesale: up to 0.0081 measured. (At lr 1e-2 the same runs drift chaotically: one Llama
    run's bfloat16 and float32 trajectories part by 0.1 for a dozen steps, other seeds by 0.01.)
    """
    argv = [*TREND, *model_flags(arch, flags, model)]
    losses = run_on_ranks(world, train_worker, [*argv, *flags, "--dtype", "bfloat16", "--out", str(tmp_path)],
                          timeout=300)[0]["losses"]
    one_device, float32 = (one_rank((*argv, "--dtype", dtype))["losses"] for dtype in ("bfloat16", "float32"))
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.5  # it trains
    for reference in (one_device, float32):
        assert max(abs(a - b) for a, b in zip(losses, reference)) < (0.02 if model else 0.005), (losses, reference)
    assert losses != float32  # it did compute in bfloat16


# ---------------------------------------------------------------------------
# What bfloat16 sends: half of float32's, but the gradients' reduction (unless --reduce-dtype bfloat16)
# ---------------------------------------------------------------------------

# Every dimension and ZeRO's gathers, in two runs: tp with sp, pp, ep (every expert chosen by every token,
# so routing is balanced whatever the dtype rounds) and ZeRO-1 on 8 ranks; cp with ZeRO-3 on 4.
TRAFFIC = {"tp-sp-pp-ep-zero1": (8, ["--tp", "2", "--sp", "--pp", "2", "--ep", "2", "--experts", "4", "--top-k", "4",
                                     "--zero", "1"]),
           "cp-zero3": (4, ["--cp", "2", "--zero", "3"])}
HALVED = ("comm_tp_all_reduce_bytes", "comm_tp_all_gather_bytes", "comm_tp_reduce_scatter_bytes",
          "comm_pp_send_recv_bytes", "comm_cp_send_recv_bytes", "comm_ep_all_to_all_bytes",
          "comm_dp_all_gather_bytes")  # ZeRO's gathers of the weights
REDUCTION = ("comm_dp_reduce_scatter_bytes", "comm_dp_all_reduce_bytes")


def cross_entropy_statistics(argv, world):
    """Each rank's bytes of tp's vocabulary-parallel cross-entropy, which stay float32 (the loss's statistics,
    not activations): per token the largest logit, then the target's logit and the sum of exponentials,
    all-reduced over tp on the last pipeline stage, per micro-batch."""
    args = cli.parse_args(argv)
    if args.tp == 1:
        return [0] * world
    tokens = args.batch_size // (args.micro_batches * world // (args.tp * args.pp * args.cp)) * args.seq_len // args.cp
    per_micro_batch = sum(ring_bytes_sent("all_reduce", n * tokens * 4, args.tp) for n in (1, 2))
    last_stage = [rank // (args.cp * args.tp) % args.pp == args.pp - 1 for rank in range(world)]  # mesh.py
    return [per_micro_batch * args.micro_batches * last for last in last_stage]


def counted(tmp_path, world, argv):
    """Every rank's counters of the run's one step, and tools/plan/'s prediction checked against them."""
    run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, argv, world)
    (record,) = logged_records(tmp_path)
    return record


@pytest.mark.parametrize("layout", TRAFFIC)
def test_bfloat16_sends_half_of_float32_but_reduces_gradients_in_float32(tmp_path, layout):
    world, flags = TRAFFIC[layout]
    argv = [*BASE, *flags, "--steps", "1"]
    fp32 = counted(tmp_path / "fp32", world, [*argv, "--dtype", "float32"])
    bf16 = counted(tmp_path / "bf16", world, [*argv, "--dtype", "bfloat16"])
    halved_reduction = counted(tmp_path / "reduce", world, [*argv, "--dtype", "bfloat16", "--reduce-dtype", "bfloat16"])
    statistics = cross_entropy_statistics(argv, world)
    for record in (fp32, bf16, halved_reduction):  # the loss's float32 statistics apart
        record["comm_tp_all_reduce_bytes"] = [n - s for n, s in zip(record["comm_tp_all_reduce_bytes"], statistics)]
    sent = [field for field in HALVED if any(fp32[field])]
    assert len(sent) >= (6 if layout == "tp-sp-pp-ep-zero1" else 2), sent  # the layout really sends them
    for field in sent:
        assert bf16[field] == [n // 2 for n in fp32[field]] and all(n % 2 == 0 for n in fp32[field]), field
        assert halved_reduction[field] == bf16[field], field
    gradients = "comm_dp_reduce_scatter_bytes"  # (the all-reduces are the norm's float64 and the used-mask)
    assert any(fp32[gradients]) and bf16[gradients] == fp32[gradients]
    assert halved_reduction[gradients] == [n // 2 for n in fp32[gradients]]
    assert bf16["comm_dp_all_reduce_bytes"] == fp32["comm_dp_all_reduce_bytes"]
    # The master weights (float32) and their moments stay as float32's; the weights themselves halve.
    assert bf16["optim_bytes"] == fp32["optim_bytes"]


def test_without_zero_the_gradient_all_reduce_is_float32_unless_asked(tmp_path):
    argv = [*BASE, "--steps", "1", "--tp", "2"]  # dp 2 x tp 2
    fp32 = counted(tmp_path / "fp32", 4, [*argv, "--dtype", "float32"])
    bf16 = counted(tmp_path / "bf16", 4, [*argv, "--dtype", "bfloat16"])
    halved = counted(tmp_path / "reduce", 4, [*argv, "--dtype", "bfloat16", "--reduce-dtype", "bfloat16"])
    assert any(fp32["comm_dp_all_reduce_bytes"])
    assert bf16["comm_dp_all_reduce_bytes"] == fp32["comm_dp_all_reduce_bytes"]
    assert halved["comm_dp_all_reduce_bytes"] == [n // 2 for n in fp32["comm_dp_all_reduce_bytes"]]
    statistics = cross_entropy_statistics(argv, 4)
    assert [n - s for n, s in zip(bf16["comm_tp_all_reduce_bytes"], statistics)] == \
        [(n - s) // 2 for n, s in zip(fp32["comm_tp_all_reduce_bytes"], statistics)]


# ---------------------------------------------------------------------------
# No weight cast again per micro-batch
# ---------------------------------------------------------------------------

def weight_copies_saved(argv):
    """train.py's run of argv, watching what its activation meter counts: every saved tensor that equals a
    weight of this rank in value and shape, in the saved tensor's dtype (what autocast's cast copy of a
    float32 weight would be, or a bfloat16 weight's own copy). Returns their shapes."""
    found = []
    pack, init = meter.ActivationMeter._pack, meter.ActivationMeter.__init__

    def watching_init(self, params=()):
        init(self, params)
        self.weights = list(params)

    def watching_pack(self, tensor):
        packed = pack(self, tensor)
        if packed is not tensor:  # an activation, not a parameter
            found.extend(tuple(tensor.shape) for w in self.weights if w.shape == tensor.shape and w.numel() > 1
                         and torch.equal(w.detach().to(tensor.dtype), tensor))
        return packed

    meter.ActivationMeter.__init__, meter.ActivationMeter._pack = watching_init, watching_pack
    train.train(train.parse_args(argv))
    return found


@pytest.mark.parametrize("world,flags", [(1, []), (2, ["--tp", "2"])], ids=["one-rank", "tp2"])
def test_no_activation_holds_a_copy_of_a_weight(tmp_path, world, flags):
    argv = [*BASE, *flags, "--steps", "1", "--dtype", "bfloat16", "--out", str(tmp_path)]
    for found in run_on_ranks(world, weight_copies_saved, argv, timeout=300):
        assert found == []


# ---------------------------------------------------------------------------
# Nothing lost at a checkpoint: it keeps the float32 master, and the bfloat16 weights are its rounding
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("world,flags", [(2, ["--zero", "1"]), (2, ["--tp", "2"])], ids=["zero1-dp2", "tp2"])
def test_bfloat16_run_stopped_and_resumed_equals_the_run_uninterrupted(tmp_path, world, flags):
    argv = [*BASE, *flags, "--steps", "4", "--dtype", "bfloat16", "--checkpoint-interval", "2"]
    whole = run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path / "whole")], timeout=300)[0]
    resumed = tmp_path / "resumed"
    first = run_on_ranks(world, train_worker, [*argv, "--stop-at", "2", "--out", str(resumed)], timeout=300)[0]
    second = run_on_ranks(world, train_worker, [*argv, "--resume", "auto", "--out", str(resumed)], timeout=300)[0]
    assert first["losses"] + second["losses"] == whole["losses"]  # bitwise: the same arithmetic
    assert second["state_dict"]["lm_head.weight"].dtype == torch.bfloat16
    for name, expected in whole["state_dict"].items():
        assert torch.equal(second["state_dict"][name], expected), name
