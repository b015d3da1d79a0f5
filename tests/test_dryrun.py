"""tools/dryrun.py: one rank of a large world, alone, its peers PyTorch's fake ones, counts what the real run
would (tools/plan/'s prediction, exactly) and writes nothing."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from distributed import REPO
from planned import here
from tools import plan
from training import cli

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

TINY = ["--model", "tiny", "--batch-size", "32", "--dtype", "float32"]


def dry_run(*argv, timeout=120, fixed_threshold=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"MALLOC_MMAP_THRESHOLD_": "65536"} if fixed_threshold else {}))
    return subprocess.run([sys.executable, "-m", "tools.dryrun", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("rank,flags", [
    (37, ["--tp", "2", "--zero", "3"]),
    (13, ["--tp", "2", "--sp", "--pp", "2", "--layers", "4", "--micro-batches", "2", "--zero", "1"]),
    (62, ["--cp", "2", "--tp", "2", "--arch", "llama", "--head-dim", "16", "--qk-norm", "--recompute", "full",
           "--zero", "2"]),  # heads wider than d_model / n_head, with QK-norm (Qwen3's attention)
    (21, ["--pp", "2", "--layers", "4", "--micro-batches", "2", "--zero", "3", "--dp-shard", "4", "--batch-size", "64"]),
    # Experts under tp without ep: each tp rank routes its own part of the tokens (a split it knows alone) and
    # all-gathers the outputs, again in the recomputation (the shared expert's tensors come after).
    (45, ["--tp", "2", "--experts", "4", "--top-k", "2", "--shared-experts", "1", "--recompute", "full", "--zero", "1"]),
    # Expert parallelism (and expert tp), routed as the planner assumes, balanced (tools/dryrun.balanced_experts)
    # (in float8: the maxima reduced over tp and expert tp)
    (29, ["--ep", "4", "--expert-tp", "2", "--tp", "2", "--sp", "--experts", "8", "--top-k", "2", "--zero", "1",
          "--fp8", "rowwise"]),
    # DeepSeek's latent attention (values narrower than keys), on one device's composite core and cp's ring, with
    # its sigmoid router's group-limited routing over ep
    (50, ["--arch", "deepseek", "--tp", "2", "--sp", "--recompute", "selective", "--zero", "2", "--fp8", "tensorwise"]),
    (7, ["--arch", "deepseek", "--cp", "2", "--experts", "4", "--top-k", "2", "--shared-experts", "1",
         "--expert-groups", "2", "--group-top-k", "1", "--ep", "4", "--zero", "1", "--aux-loss-scope", "sequence"]),
    # A window on every second layer and sinks under a cp=4 ring: rank 4 is cp rank 2, whose ring sends less
    # than rank 0's (the planner's per-rank figure), and the core keeps no mask
    (4, ["--cp", "4", "--tp", "2", "--arch", "llama", "--seq-len", "32", "--sliding-window", "5", "--window-layers",
         "1:1", "--attention-sinks", "--zero", "1"]),
    # Combined 1F1B on the last of 4 stages: a pair's halves hand over at each all-to-all, its peak between them
    # (the targets' view of the batch let go by the backward's loss until the forward's)
    (3, ["--pp", "4", "--layers", "4", "--micro-batches", "8", "--batch-size", "128", "--ep", "2", "--experts", "4",
         "--top-k", "2", "--schedule", "combined", "--ep-overlap", "1", "--zero", "1"]),
    (21, ["--pp", "4", "--layers", "4", "--micro-batches", "8", "--batch-size", "128", "--ep", "2", "--experts", "4",
          "--top-k", "2", "--schedule", "combined", "--ep-overlap", "1", "--zero", "1", "--recompute", "full"]),
    # and without a pipeline: the pairs alone, whose schedule defers ZeRO-3's reduction and keeps its units
    (5, ["--micro-batches", "4", "--batch-size", "256", "--ep", "4", "--experts", "4", "--top-k", "2", "--schedule",
         "combined", "--ep-overlap", "1", "--zero", "3"]),
], ids=["tp2-zero3", "tp2-sp-pp2-zero1", "qwen3-attention-cp2-tp2-recomputed-zero2", "pp2-zero3-hybrid4",
        "tp2-experts-shared-recomputed-zero1", "ep4-expert-tp2-tp2-sp-zero1", "deepseek-tp2-sp-selective-zero2",
        "deepseek-cp2-ep4-groups-per-sequence-zero1", "window-sinks-cp4-ring-tp2-zero1", "combined-pp4-last-ep2-zero1",
        "combined-pp4-second-ep2-recomputed-zero1", "combined-ep4-zero3"])
def test_one_rank_of_64_counts_what_plan_predicts_and_writes_nothing(tmp_path, rank, flags):
    out = dry_run("--world", "64", "--rank", str(rank), "--json", *TINY, *flags, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    measured, predicted = report["measured"], report["predicted"]
    assert predicted["param_bytes"] > 0 and any(v for f, v in predicted.items() if f.startswith("comm_"))
    peak = predicted.pop("peak_resident_bytes")
    for field, value in predicted.items():
        assert measured[field] == value, field
    # A tiny model: the peak is mostly the interpreter and PyTorch themselves (the process before building).
    assert abs(measured["peak_resident_bytes"] / here(peak, measured["process_bytes"]) - 1) < 0.15
    assert "loss" not in measured
    assert os.listdir(tmp_path) == []  # no log, no checkpoint


def test_one_rank_of_deepseek_v3_671b_on_2048_counts_what_plan_predicts():
    """DeepSeek-V3 671B's blocks (the preset: latent attention, 256 experts in 8 groups, sigmoid router), 8 of
    its layers on 8 pipeline stages: a rank of 2048 whose stage holds an MoE layer, with tp 8 and one expert
    (ep 256, folded over the stage's dp x tp), balanced per sequence, short sequences so that the step is quick. Every counter is the
    planner's. Its peak is the planner's step's less at most AdamW's moments: the planner's is a step's once
    the moments exist, and this first step makes them only after the gradient norm, whose float64 squares of
    its largest piece (a whole expert matrix: it shards over its one rank) are its peak (glibc handing back
    what it frees, as in the test below)."""
    out = dry_run("--world", "2048", "--rank", "1250", "--json", "--model", "deepseek-v3", "--arch", "deepseek",
                  "--layers", "8", "--pp", "8", "--tp", "8", "--sp", "--ep", "256", "--zero", "1", "--seq-len", "64",
                  "--batch-size", "256", "--dtype", "bfloat16", "--aux-loss-scope", "sequence", timeout=300,
                  fixed_threshold=True)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    measured, predicted = report["measured"], report["predicted"]
    peak = predicted.pop("peak_resident_bytes")
    assert predicted["comm_ep_all_to_all_bytes"] > 0 and predicted["param_bytes"] > 2**27
    assert {field: measured[field] for field in predicted} == predicted
    peak = here(peak, measured["process_bytes"])
    assert 0.95 * (peak - predicted["optim_bytes"]) < measured["peak_resident_bytes"] < 1.05 * peak


def layout_flags(layout):
    """train.py's flags of a tools/plan/ Layout's dimensions, as --search varies them."""
    flags = [f"--{flag}={getattr(layout, flag.replace('-', '_'))}" for flag in ("tp", "pp", "cp", "ep", "expert-tp",
                                                                             "zero")]
    flags += ["--recompute", layout.recompute, *(["--sp"] if layout.sp else [])]
    return flags + (["--dp-shard", str(layout.dp_shard)] if layout.replicas > 1 else [])


def test_one_rank_of_gpt_oss_20b_in_the_layout_search_puts_first_counts_what_plan_predicts():
    """gpt-oss-20b (the preset: 64 query heads of 64 over 8 key/value heads, biases, sinks, windows of 128 on
    every second layer, 32 experts of 2,880, top 4, its 201,088 x 2,880 tables whole) in the layout --search
    puts first on 8 GPUs of 80 GB, 2 of its 24 blocks (one windowed, one not) and sequences of 256 so that a
    CPU steps it: every counter of a rank is the planner's, and its peak resident memory within 5% of the
    plan's (below it by no more than AdamW's moments, which a dry run's one step creates after its peak, as
    the DeepSeek-V3 case above). Its vocabulary tables are 2.2 GiB each in float32: under ZeRO-2 each a bucket
    of its own, with autograd's gradient of the table beside it before it is copied in (peak.zero_working)."""
    gpt_oss = ["--model", "gpt-oss-20b", "--arch", "gpt-oss"]
    plan_args, args = plan.parse_args([*gpt_oss, "--world", "8", "--search", "--memory", "80GB", "--top", "1"])
    first = plan.search(args, plan_args)[0][-1]
    assert plan.layout_of(cli.parse_args([*gpt_oss, *layout_flags(first)]), 8) == first
    out = dry_run("--world", "8", "--rank", "5", "--json", *gpt_oss, *layout_flags(first), "--layers", "2",
                  "--seq-len", "256", timeout=600, fixed_threshold=True)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    measured, predicted = report["measured"], report["predicted"]
    peak = predicted.pop("peak_resident_bytes")
    assert predicted["param_bytes"] > 0 and predicted["comm_ep_all_to_all_bytes"] > 0
    assert {field: measured[field] for field in predicted} == predicted
    peak = here(peak, measured["process_bytes"])
    assert 0.95 * (peak - predicted["optim_bytes"]) < measured["peak_resident_bytes"] < 1.05 * peak


@pytest.mark.parametrize("flags,message", [
    (["--rank", "64"], "--rank 64: a rank of --world 64 is between 0 and 63"),
    (["--rank", "3", "--tp", "3"], "not divisible by tp*pp*cp = 3*1*1"),
])
def test_a_layout_it_cannot_run_is_refused_with_the_reason(flags, message):
    out = dry_run("--world", "64", *TINY, "--batch-size", "64", *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-3000:]


def test_skipped_arithmetic_answers_products_and_attention_with_zeros_of_their_shape():
    from tools.dryrun import SkipArithmetic
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with SkipArithmetic():
        product = a @ b
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
        summed = a + 1  # not arithmetic it skips
    assert product.shape == (3, 2) and not product.any()
    assert out.shape == q.shape and not out.any() and not q.grad.any()
    assert torch.equal(summed, a + 1)


def test_skipping_the_arithmetic_keeps_every_counter_and_the_peak():
    """The same rank with the products computed (--compute) and skipped: every counted byte equal, and the
    peak resident memory within 1% (the skipped products' outputs are allocated and written all the same),
    with glibc handing back every large block it frees (a fixed mmap threshold). Left to its own threshold,
    glibc keeps on its heap some of what the computation frees (the matrix libraries' workspaces among it):
    the computed rank's peak is then up to 8% higher, a figure of the allocator's, not of the step's tensors."""
    argv = ["--world", "16", "--rank", "5", "--json", "--model", "medium", "--batch-size", "16", "--seq-len", "256",
            "--tp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2"]
    skipped, computed = (json.loads(dry_run(*argv, *extra, timeout=300, fixed_threshold=True).stdout)["measured"]
                         for extra in ([], ["--compute"]))
    peak = skipped.pop("peak_resident_bytes"), computed.pop("peak_resident_bytes")
    skipped.pop("process_bytes"), computed.pop("process_bytes")  # (each process's own, before building)
    assert skipped == computed
    assert abs(peak[0] / peak[1] - 1) < 0.01, peak
