"""tools/plan.py: its predictions equal what train.py counts, and it answers for real sizes in seconds.

The benchmark table's configurations (and the 16- and 32-rank runs, ZeRO with tp) are checked against the
planner where they run, in test_compose.py; here a seeded random sample of composed layouts adds ZeRO
stages, sequence parallelism, recomputation, interleaving, several buckets and other dtypes.
"""
import json
import math
import random
import subprocess
import sys

import pytest

from training import cli
from tools import plan
import train
from distributed import REPO, run_on_ranks
from oracle import train_worker
from planned import assert_matches_plan

# Two steps of the tiny model, with buckets of 50 KB (several per rank: ZeRO's shards then cut parameters
# into pieces, each with its own step count). Experts are chosen by every token (top-k = experts), so
# routing is balanced by construction and the MoE's traffic and activations are exact too.
BASE = ["--model", "tiny", "--layers", "4", "--steps", "2", "--batch-size", "16", "--dtype", "float64",
        "--bucket-mb", "0.05", "--eval-interval", "1000"]


def sampled_layouts(n, seed=5):
    """n layouts train.py accepts on 4 or 8 ranks, drawn at random over every option tools/plan.py models."""
    rng = random.Random(seed)
    layouts = []
    while len(layouts) < n:
        world = rng.choice([4, 8])
        sizes = {dim: rng.choice([1, 1, 2]) for dim in ("tp", "pp", "cp", "ep")}
        flags = [f"--{dim}={size}" for dim, size in sizes.items()]
        flags += ["--zero", str(rng.choice([0, 1, 2, 3])), "--recompute", rng.choice(["none", "selective", "full"]),
                  "--arch", rng.choice(["gpt", "llama"]), "--micro-batches", str(rng.choice([1, 2, 4]))]
        if sizes["tp"] > 1 and rng.random() < 0.5:
            flags.append("--sp")
        if sizes["pp"] > 1:
            flags += ["--schedule", rng.choice(["gpipe", "1f1b", "interleaved"])]
        if sizes["ep"] > 1 or rng.random() < 0.3:
            flags += ["--experts", "4", "--top-k", "4", "--shared-experts", str(rng.choice([0, 1]))]
        try:
            cli.check_args(cli.parse_args([*BASE, *flags]), world)
        except cli.ConfigError:
            continue
        layouts.append((world, flags))
    return layouts


SAMPLE = sampled_layouts(6) + [(4, ["--tp=2", "--sp", "--dtype", "float32", "--arch", "llama"]),
                               (4, ["--ep=2", "--experts", "4", "--top-k", "4", "--zero", "3", "--micro-batches", "2"]),
                               (4, ["--cp=2", "--pp=2", "--dtype", "bfloat16", "--micro-batches", "2"])]


@pytest.mark.parametrize("world,flags", SAMPLE, ids=[f"{w}-{' '.join(f)}" for w, f in SAMPLE])
def test_prediction_equals_every_counter(tmp_path, world, flags):
    argv = [*BASE, *flags]
    run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, argv, world)


def run_plan(*argv):
    result = subprocess.run([sys.executable, "-m", "tools.plan", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    return result


def test_json_holds_log_fields_per_rank():
    result = run_plan("--world", "8", "--tp", "2", "--pp", "2", "--zero", "1", "--json")
    assert result.returncode == 0, result.stderr
    predicted = json.loads(result.stdout)
    logged = {"param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes", *train.COMM_FIELDS}
    peaks = {f"{phase}_peak_bytes" for phase in ("startup", "step", "save", "load")} | {"peak_bytes"}
    assert set(predicted) == logged | {"recompute_bytes"} | peaks
    assert all(len(values) == 8 for values in predicted.values())


LLAMA_405B = ["--model", "llama3-405b", "--arch", "llama", "--world", "16384", "--batch-size", "2048",
              "--micro-batches", "16", "--dtype", "bfloat16"]
ARTICLE_LAYOUT = ["--tp", "8", "--sp", "--pp", "16", "--zero", "1"]  # with dp = 16384 / (8 * 16) = 128


def test_article_example_405b_weights_per_rank():
    """The article's 405B layout: a rank holds 1/(tp*pp) of the blocks' weights (a stage of 8 of the 126
    layers, 1/8 of each), besides the replicated norms, in bfloat16, and ZeRO-1's float32 master shard of
    them, 1/128 (padded to 128 ranks)."""
    args = cli.parse_args([a for a in LLAMA_405B if a not in ("--world", "16384")] + ARTICLE_LAYOUT)
    predicted = plan.predict(args, 16384)
    c = cli.model_config(args, cli.data_vocab_size(args))
    h, kv, ff = c.d_model, c.kv_dim, c.d_ff
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ff  # q|k|v, proj; SwiGLU's gate, up, down
    first_stage = c.vocab_size * h // 8 + 8 * (per_layer // 8 + 2 * h)  # 126 = 14 stages of 8, 2 of 7
    weights_and_master = 2 * first_stage + 4 * first_stage / 128
    assert 0 <= predicted["param_bytes"][0] - weights_and_master < 6 * 128 * 64  # padding: < 128 a bucket
    assert predicted["grad_bytes"][0] > predicted["param_bytes"][0]  # ZeRO-1: full gradient and its shard


def test_search_finds_the_article_layout_only_with_recomputation():
    result = run_plan(*LLAMA_405B, "--search", "--memory", "80GiB", "--top", "0")
    assert result.returncode == 0, result.stderr
    fits = {tuple(line.split()[:7]) for line in result.stdout.splitlines()[2:]}
    article = ("128", "8", "16", "1", "1", "1")
    assert (*article, "full") in fits
    assert (*article, "none") not in fits and (*article, "selective") not in fits
    by_node = [float(line.split()[8]) for line in result.stdout.splitlines()[2:]]
    assert by_node == sorted(by_node)  # least traffic across nodes first


def test_refused_flags_say_why():
    result = run_plan("--world", "4", "--tp", "3")
    assert result.returncode != 0
    assert "python -m tools.plan: error: world size 4 is not divisible by tp*pp*cp*ep" in result.stderr


def test_real_shapes_have_their_parameter_counts():
    """Llama 3 8B, 70B, 405B and Mixtral 8x7B as --arch llama builds them (untied heads, as they are)."""
    expected = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "mixtral": 46.7e9}
    for model, count in expected.items():
        experts = ["--experts", "8", "--top-k", "2"] if model == "mixtral" else []
        args = cli.parse_args(["--model", model, "--arch", "llama", *experts])
        config = cli.model_config(args, cli.data_vocab_size(args))
        n = sum(math.prod(shape) for _, shape in plan.model_parameters(plan.config_key(config)))
        assert abs(n - count) / count < 0.005, (model, n)
