"""tools/plan/: its predictions equal what train.py counts, and it answers for real sizes in seconds.

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
import mesh
import train
from distributed import REPO, run_on_ranks, torchrun
from oracle import train_worker
from planned import assert_matches_plan, here, logged_records

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

# Two steps of the tiny model, with buckets of 50 KB (several per rank: ZeRO's shards then cut parameters
# into pieces, each with its own step count). Experts are chosen by every token (top-k = experts), so
# routing is balanced by construction and the MoE's traffic and activations are exact too.
BASE = ["--model", "tiny", "--layers", "4", "--steps", "2", "--batch-size", "16", "--dtype", "float64",
        "--bucket-mb", "0.05", "--eval-interval", "1000"]


def sampled_layouts(n, seed=5):
    """n layouts train.py accepts on 4 or 8 ranks, drawn at random over every option tools/plan/ models (ep
    and expert-tp folded over each stage's ranks)."""
    rng = random.Random(seed)
    layouts = []
    while len(layouts) < n:
        world = rng.choice([4, 8])
        sizes = {dim: rng.choice([1, 1, 2]) for dim in ("tp", "pp", "cp", "ep", "expert-tp")}
        flags = [f"--{dim}={size}" for dim, size in sizes.items()]
        flags += ["--zero", str(rng.choice([0, 1, 2, 3])), "--recompute", rng.choice(["none", "selective", "full"]),
                  "--arch", rng.choice(["gpt", "llama"]), "--micro-batches", str(rng.choice([1, 2, 4]))]
        if sizes["tp"] > 1 and rng.random() < 0.5:
            flags.append("--sp")
        if sizes["pp"] > 1:
            flags += ["--schedule", rng.choice(["gpipe", "1f1b", "interleaved"])]
        if sizes["ep"] > 1 or sizes["expert-tp"] > 1 or rng.random() < 0.3:
            flags += ["--experts", "4", "--top-k", "4", "--shared-experts", str(rng.choice([0, 1]))]
        try:
            cli.check_args(cli.parse_args([*BASE, *flags]), world)
        except cli.ConfigError:
            continue
        layouts.append((world, flags))
    return layouts


# (QK-norm in float32 with rotary positions and in bfloat16 without: what its norms keep, and their gradients' sums)
SAMPLE = sampled_layouts(6) + [(4, ["--tp=2", "--sp", "--dtype", "float32", "--arch", "llama", "--head-dim", "12",
                                    "--qk-norm"]),
                               (4, ["--ep=2", "--experts", "4", "--top-k", "4", "--zero", "3", "--micro-batches", "2"]),
                               (4, ["--cp=2", "--pp=2", "--dtype", "bfloat16", "--micro-batches", "2", "--qk-norm"])]


@pytest.mark.parametrize("world,flags", SAMPLE, ids=[f"{w}-{' '.join(f)}" for w, f in SAMPLE])
def test_prediction_equals_every_counter(tmp_path, world, flags):
    argv = [*BASE, *flags]
    run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, argv, world)


# ZeRO-2 and 3 under pipelines (one reduction a step, ZeRO-3 one gather) and hybrid sharding (--dp-shard: the
# shards' all-reduce over the copies, the step counters of a rank's shard group), alone and composed.
EXPERTS = ["--experts", "4", "--top-k", "4"]
PIPELINED_AND_HYBRID = [
    (4, ["--zero", "2", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "2"]),
    (8, ["--zero", "3", "--pp", "2", "--schedule", "zbv", "--micro-batches", "2", *EXPERTS, "--ep", "2"]),
    (8, ["--zero", "3", "--dp-shard", "2", "--tp", "2", "--micro-batches", "2"]),
    (8, ["--zero", "2", "--dp-shard", "2", "--pp", "2", "--micro-batches", "2"]),
    (8, ["--zero", "1", "--dp-shard", "2", *EXPERTS, "--ep", "2"]),
]


@pytest.mark.parametrize("world,flags", PIPELINED_AND_HYBRID, ids=[f"{w}-{' '.join(f)}" for w, f in PIPELINED_AND_HYBRID])
def test_pipelined_and_hybrid_zero_equal_every_counter(tmp_path, world, flags):
    argv = [*BASE, *flags]
    run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300)
    assert_matches_plan(tmp_path, argv, world)


def test_pipelined_zero3_peak_holds_the_stage_whole(tmp_path, monkeypatch):
    """Under a pipeline ZeRO-3 keeps every unit of its stage gathered, with its full gradients, from its first
    forward to its reduce-scatter: the step's peak resident memory (log.jsonl's, after the second step, when
    AdamW's moments exist) is tools/plan/'s peak of start-up and step, on each rank's own process baseline
    (planned.here), within 15% on every rank (measured: 0
    to 2% above it); with two units whole, as without a pipeline, it would be 25% short. Thin layers, many of
    them (16 blocks a stage), in float64: the state dominates the interpreter. glibc hands back every large
    block it frees (a fixed mmap threshold, as tests/test_dryrun.py sets it): left to its own threshold it
    keeps on its heap some of what each step frees (here 6 to 10% more; with GPT-2's blocks, 28 MB units,
    25%), a figure of the allocator's, not of the step's tensors."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    argv = ["--model", "medium", "--layers", "32", "--dtype", "float64", "--seq-len", "32", "--batch-size", "4",
            "--micro-batches", "2", "--steps", "2", "--pp", "2", "--zero", "3", "--eval-interval", "1000",
            "--eval-batches", "1"]
    out = torchrun(4, "train.py", *argv, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    record = logged_records(tmp_path)[-1]
    measured = record["peak_resident_bytes"]
    peaks = plan.predict_peaks(cli.parse_args(argv), 4)  # (the checkpoint is saved after the last record)
    predicted = [here(max(startup, step), process) for startup, step, process in
                 zip(peaks["startup_peak_bytes"], peaks["step_peak_bytes"], record["process_bytes"])]
    assert all(abs(m / p - 1) < 0.15 for m, p in zip(measured, predicted)), (measured, predicted)


def test_search_tries_hybrid_sharding_and_counts_its_copies_across_nodes(capsys):
    """--search's candidates include ZeRO sharded over a node's dp ranks with copies in the others; for 16 ranks as
    dp=8 (shards over 4, 2 copies) x tp=2 on nodes of 8, the shard groups' collectives stay inside a node and
    the all-reduce over the copies alone crosses."""
    plan_args, search_args = plan.parse_args(["--model", "tiny", "--world", "16", "--search", "--top", "0"])
    hybrid = [layout for _, layout in plan.candidate_layouts(search_args, 16, 8) if layout.replicas > 1]
    assert any(layout.zero == 3 and layout.dp_shard * layout.world // layout.dp <= 8 for layout in hybrid)
    assert {layout.zero for layout in hybrid} == {1, 2, 3}
    fits = plan.search(search_args, plan_args)
    assert any(layout.replicas > 1 for *_, layout in fits)
    assert "dp-shard" in capsys.readouterr().out
    _, args = plan.parse_args(["--model", "tiny", "--world", "16", "--tp", "2", "--zero", "3", "--dp-shard", "4"])
    layout = plan.layout_of(args, 16)
    config = cli.model_config(args, cli.data_vocab_size(args))
    prediction = plan.predict_stage(config, layout, 0)
    traffic = {group: sum(counter.values()) for group, counter in prediction["traffic"].items()}
    assert traffic["dense_replicas"] > 0 and traffic["dense"] > 0 and traffic["tp"] > 0
    for rank in (0, 5, 10, 15):
        inside, across = plan.node_split(layout, prediction, plan.coordinates(layout, rank), 8)
        assert (inside, across) == (traffic["dense"] + traffic["tp"], traffic["dense_replicas"]), rank


@pytest.mark.parametrize("flags", [["--tp", "2", "--pp", "2", "--zero", "1", "--dp-shard", "2"],
                                   ["--cp", "2", "--ep", "2", *EXPERTS, "--zero", "2", "--dp-shard", "2"],
                                   ["--zero", "3", "--dp-shard", "4"], ["--tp", "2", "--cp", "2", "--zero", "3"],
                                   # experts folded over a stage's ranks: ep over cp x tp, and with expert-tp
                                   ["--tp", "2", "--cp", "2", "--ep", "4", *EXPERTS, "--zero", "1"],
                                   ["--tp", "2", "--pp", "2", "--ep", "2", "--expert-tp", "2", *EXPERTS,
                                    "--zero", "1", "--dp-shard", "2"]])
def test_crosses_nodes_agrees_with_the_mesh_groups(flags):
    """Every traffic group of every rank of 32, on nodes of 2, 4 and 8: crosses_nodes tells whether mesh.py's
    group of that rank holds ranks of two nodes (the hybrid groups read dp as (copies, shards); the experts'
    groups are read from their own grid, folded over each stage's ranks)."""
    args = cli.parse_args(["--model", "small", "--batch-size", "64", *flags])
    layout = plan.layout_of(args, 32)
    for group, axes in plan.TRAFFIC_GROUPS.items():
        groups = mesh.group_ranks(layout.mesh_shape, axes)
        for rank in range(32):
            (ranks,) = [ranks for ranks in groups if rank in ranks]
            for node in (2, 4, 8):
                crosses = plan.crosses_nodes(layout, plan.coordinates(layout, rank), axes, node)
                assert crosses == (len({r // node for r in ranks}) > 1), (group, rank, node)


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
    fits = {tuple(line.split()[:9]) for line in result.stdout.splitlines()[2:]}
    article = ("128", "8", "16", "1", "1", "1", "1", "-")  # dp tp pp cp ep etp ZeRO (-: shards span all 128 dp ranks)
    assert (*article, "full") in fits
    assert (*article, "none") not in fits and (*article, "selective") not in fits
    by_node = [float(line.split()[10]) for line in result.stdout.splitlines()[2:]]
    assert by_node == sorted(by_node)  # least traffic across nodes first


def test_refused_flags_say_why():
    result = run_plan("--world", "4", "--tp", "3")
    assert result.returncode != 0
    assert "python -m tools.plan: error: world size 4 is not divisible by tp*pp*cp" in result.stderr


def test_real_shapes_have_their_parameter_counts():
    """Llama 3 8B, 70B, 405B and Mixtral 8x7B as --arch llama builds them (untied heads, as they are)."""
    expected = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "mixtral": 46.7e9}
    for model, count in expected.items():
        experts = ["--experts", "8", "--top-k", "2"] if model == "mixtral" else []
        args = cli.parse_args(["--model", model, "--arch", "llama", *experts])
        config = cli.model_config(args, cli.data_vocab_size(args))
        n = sum(math.prod(shape) for _, shape in plan.model_parameters(plan.config_key(config)))
        assert abs(n - count) / count < 0.005, (model, n)


# Muon (--optimizer muon): the blocks' matrices (q, k, v, the attention's proj, gate, up and the MLP's proj of
# the tiny Llama) keep one momentum where AdamW keeps two moments, and are assembled whole over a stage's ranks.
MUON = ["--model", "tiny", "--arch", "llama", "--dtype", "float64", "--batch-size", "8", "--optimizer", "muon"]


def muon_matrices(args):
    """[(name, rows)] of the logical matrices of a tiny Llama, in its parameters' order, each with the
    flattened parameter's rows it stacks (q | k | v in qkv, gate | up in fc), and the model width."""
    c = cli.model_config(args, cli.data_vocab_size(args))
    matrices = []
    for layer in range(c.n_layer):
        block = f"blocks.{layer}"
        matrices += [(f"{block}.attn.qkv.weight", [c.q_dim, c.kv_dim, c.kv_dim]),
                     (f"{block}.attn.proj.weight", [c.d_model]),
                     (f"{block}.mlp.fc.weight", [c.d_ff, c.d_ff]), (f"{block}.mlp.proj.weight", [c.d_model])]
    return matrices, c


def test_muon_under_tp_every_rank_sends_half_of_the_matrices_once():
    """tp=2 on 2 ranks: each rank holds half of every matrix (a band of rows or of columns), so each matrix's
    owner receives the other half and sends its orthogonalised half back. The two layers give every size
    twice, so the owners split the matrices evenly: each rank sends (N-1)/N^2 of them out and as many back,
    half of all the elements (N = 2), and `gather` (each assembling every matrix, nothing sent back) as much.
    Its optimizer keeps one momentum for its half of the matrices where AdamW keeps two moments."""
    argv = [*MUON, "--tp", "2"]
    args = cli.parse_args(argv)
    matrices, c = muon_matrices(args)
    widths = {"attn.proj.weight": c.q_dim, "mlp.proj.weight": c.d_ff}
    elements = sum(sum(rows) * next((w for end, w in widths.items() if name.endswith(end)), c.d_model)
                   for name, rows in matrices)
    predicted, adamw = plan.predict(args, 2), plan.predict(cli.parse_args([*argv, "--optimizer", "adamw"]), 2)
    assert predicted["comm_optim_all_to_all_bytes"] == [elements // 2 * 8] * 2
    gather = plan.predict(cli.parse_args([*argv, "--muon-assembly", "gather"]), 2)
    assert gather["comm_optim_all_to_all_bytes"] == [elements // 2 * 8] * 2
    assert predicted["optim_bytes"] == [optim - elements // 2 * 8 for optim in adamw["optim_bytes"]]
    assert adamw["comm_optim_all_to_all_bytes"] == [0, 0]


def test_muon_under_zero1_sends_the_pieces_its_shard_cuts():
    """ZeRO-1 on 4 ranks, one bucket: the bucket holds the parameters in backward order and each rank a
    quarter of it, so a shard boundary may cut a matrix. With every holder assembling (gather) a rank sends
    its piece of a cut matrix to each other holder, and nothing of the matrices it holds whole; its optimizer
    keeps one momentum for each element of a matrix in its shard."""
    argv = [*MUON, "--zero", "1", "--muon-assembly", "gather"]
    args = cli.parse_args(argv)
    matrices, c = muon_matrices(args)
    sizes = dict(plan.model_parameters(plan.config_key(c)))
    spans, offset = [], 0  # (first, end) of each matrix in the bucket
    for name, numel in reversed([(name, math.prod(shape)) for name, shape in sizes.items()]):
        rows = dict(matrices).get(name, [])
        cols = numel // sum(rows) if rows else 0
        starts = [offset + cols * sum(rows[:i]) for i in range(len(rows) + 1)]
        spans += list(zip(starts, starts[1:]))
        offset += numel
    shard = offset // 4  # (no padding: 4 divides the bucket)
    held = [[max(0, min(end, (r + 1) * shard) - max(first, r * shard)) for r in range(4)] for first, end in spans]
    sent = [sum(pieces[r] * (sum(1 for p in pieces if p) - 1) for pieces in held) * 8 for r in range(4)]
    assert sum(sent) > 0  # (the boundaries do cut matrices: the check means something)
    adamw_argv = [*argv, "--optimizer", "adamw", "--muon-assembly", "owner"]  # (gather is Muon's alone)
    predicted, adamw = plan.predict(args, 4), plan.predict(cli.parse_args(adamw_argv), 4)
    assert predicted["comm_optim_all_to_all_bytes"] == sent
    assert predicted["optim_bytes"] == [optim - sum(pieces[r] for pieces in held) * 8
                                        for r, optim in enumerate(adamw["optim_bytes"])]


def test_dry_run_of_a_muon_rank_holds_the_planned_pieces_and_counts_the_planned_bytes():
    """One rank of 16 under PyTorch's fake peers (tools/dryrun.py), its optimizers Muon: its own pieces of the
    matrices are the Segments tools/plan/ gives it (the dry run refuses to go on otherwise), and what it
    counts (optimizer state, Muon's all-to-alls, the rest) is the prediction."""
    result = subprocess.run([sys.executable, "-m", "tools.dryrun", "--world", "16", "--rank", "6", "--json",
                             "--model", "tiny", "--arch", "llama", "--batch-size", "32", "--dtype", "float32",
                             "--optimizer", "muon", "--tp", "2", "--cp", "2", "--pp", "2", "--schedule", "zbv",
                             "--layers", "4", "--micro-batches", "2", "--zero", "1", "--bucket-mb", "0.01"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    measured, predicted = report["measured"], report["predicted"]
    predicted.pop("peak_resident_bytes")
    assert predicted["comm_optim_all_to_all_bytes"] > 0
    assert {field: measured[field] for field in predicted} == predicted


# DeepSeek-V3 (--arch deepseek): multi-head latent attention, its sigmoid router's group-limited routing.
DEEPSEEK_V3 = ["--model", "deepseek-v3", "--arch", "deepseek"]
TINY_DEEPSEEK = ["--model", "tiny", "--arch", "deepseek", "--dtype", "float64", "--batch-size", "16", "--layers", "4"]


def latent_attention_parameters(c):
    """DeepSeek-V2's equations 9 to 13 and 37 as matrices: q_down, its norm, q_up to every head's query (nope |
    rope); kv_down to the latent and the shared rotary key, the latent's norm, kv_up to every head's key (nope)
    and value; proj from the values."""
    heads, query = c.n_head, c.qk_nope_head_dim + c.qk_rope_head_dim
    return (c.d_model * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * query
            + c.d_model * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * c.d_model)


def test_deepseek_v3_preset_is_671b_with_37b_activated_per_token():
    """The preset built by model.py (on the meta device, as the planner reads it) holds DeepSeek-V3's parameters
    written out from its shapes: 3 dense layers, 58 MoE layers of 256 routed experts and a shared one, latent
    attention, untied embedding and head: 671B, of which a token meets 37B (its 8 routed experts of each MoE
    layer, everything else whole), the paper's figures (DeepSeek-V3 technical report, section 1)."""
    args = cli.parse_args(DEEPSEEK_V3)
    c = cli.model_config(args, cli.data_vocab_size(args))
    planned = sum(math.prod(shape) for _, shape in plan.model_parameters(plan.config_key(c)))
    moe_layers = sum(c.is_moe(layer) for layer in range(c.n_layer))
    assert (c.n_layer, moe_layers, c.n_experts, c.top_k) == (61, 58, 256, 8)
    expert = 3 * c.d_model * c.d_expert  # SwiGLU: gate, up, down
    mlp = {"dense": 3 * c.d_model * c.d_ff, "moe": c.n_experts * c.d_model + (c.n_experts + 1) * expert}
    block = latent_attention_parameters(c) + 2 * c.d_model
    written = (c.n_layer * block + (c.n_layer - moe_layers) * mlp["dense"] + moe_layers * mlp["moe"]
               + 2 * c.padded_vocab_size * c.d_model + c.d_model)
    assert planned == written
    activated = written - moe_layers * (c.n_experts - c.top_k) * expert
    assert abs(planned / 671e9 - 1) < 0.001 and abs(activated / 37e9 - 1) < 0.02, (planned, activated)


def test_latent_attention_replicates_its_down_projections_over_tp_and_sums_their_gradients():
    """tp.split_latent_attention: q_up and kv_up split by heads, proj by its inputs, q_down, kv_down and their
    norms whole on every rank, as norms: under sp the planner's replicated weights (whose gradients tp sums in
    every backward) are the attention's parameters it does not shard, without sp none; a tp rank holds the
    sharded ones' half besides them."""
    args = cli.parse_args([*TINY_DEEPSEEK, "--tp", "2"])
    c = cli.model_config(args, cli.data_vocab_size(args))
    attention = [(name, math.prod(shape)) for name, shape in plan.model_parameters(plan.config_key(c))
                 if name.startswith("blocks.0.attn.")]
    whole = [numel for name, numel in attention if not plan.tp_sharded(name, c)]
    assert {name.split(".")[3] for name, _ in attention if not plan.tp_sharded(name, c)} == {
        "q_down", "q_down_norm", "kv_down", "kv_down_norm"}
    assert plan.attention_of(c).summed_over_tp(c, plan.layout_of(args, 2)) == []  # whole gradients without sp
    with_sp = cli.parse_args([*TINY_DEEPSEEK, "--tp", "2", "--sp"])
    assert sorted(plan.attention_of(c).summed_over_tp(c, plan.layout_of(with_sp, 2))) == sorted(whole)
    dense, _, _ = plan.rank_parameters(c, plan.layout_of(args, 2), 0)
    held = sum(numel for name, numel in dense if name.startswith("blocks.0.attn."))
    assert held == sum(whole) + (latent_attention_parameters(c) - sum(whole)) // 2


@pytest.mark.parametrize("mode", ["ring", "allgather", "alltoall"])
def test_latent_attention_cp_carries_keys_of_head_dim_and_values_of_v_head_dim(mode):
    """cp.py's three ways with latent attention's keys (nope + rope features a head) and narrower values: every
    formula counts K and V of their own widths, and the heads' output (alltoall) of the values'."""
    args = cli.parse_args([*TINY_DEEPSEEK, "--cp", "2", "--cp-mode", mode])
    c = cli.model_config(args, cli.data_vocab_size(args))
    assert c.head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim and c.v_head_dim < c.head_dim
    tokens = 16 * c.seq_len // 2  # one micro-batch (the default) of 16 sequences, half of each
    q = k = tokens * c.n_head * c.head_dim * 8  # float64
    v = out = tokens * c.n_head * c.v_head_dim * 8
    per_layer = {"ring": {"send_recv": (2 - 1) * (k + v) + (2 - 1) * (k + v) + 2 * (k + v)},
                 "allgather": {"all_gather": 2 * (k + v), "reduce_scatter": k + v},
                 "alltoall": {"all_to_all": 2 * (q + k + v + out) // 2}}[mode]
    predicted = plan.predict(args, 2)
    for kind, sent in per_layer.items():
        assert predicted[f"comm_cp_{kind}_bytes"] == [c.n_layer * sent] * 2


def test_latent_attention_on_one_device_keeps_no_softmax_probabilities():
    """One device's core (cp.AttentionCore) keeps q, k, v (v a view of kv_up's output), the output and its
    log-sum-exp whatever computes the blocks (on CPUs latent attention's values, narrower than its keys, go to
    the written-out blocks, whose scores backward makes again): no term grows with the sequence squared, so
    twice the sequence keeps twice the bytes a block (tests/test_deepseek.py checks the figure against the
    meter)."""
    def block_bytes(seq):
        args = cli.parse_args([*TINY_DEEPSEEK, "--seq-len", str(seq)])
        c = cli.model_config(args, cli.data_vocab_size(args))
        return plan.block_activations(c, plan.layout_of(args, 1), 0)
    assert block_bytes(32) == 2 * block_bytes(16)


def test_ep_all_to_all_splits_inside_and_across_nodes_by_where_the_peers_are():
    """ep over 16 ranks on nodes of 4 (no pipeline: an ep group is 16 consecutive ranks): a rank sends each peer
    as much under balanced routing, so 3 of its 15 peers' share stays inside its node. With 4 expert groups (4
    experts each) a group's experts lie on one node, and a token, choosing 2 groups, reaches at most 2 nodes."""
    args = cli.parse_args(["--model", "tiny", "--arch", "deepseek", "--batch-size", "16", "--experts", "16",
                           "--top-k", "4", "--expert-groups", "4", "--group-top-k", "2", "--ep", "16"])
    c = cli.model_config(args, cli.data_vocab_size(args))
    layout = plan.layout_of(args, 16)
    prediction = plan.predict_stage(c, layout, 0)
    traffic = {group: sum(counter.values()) for group, counter in prediction["traffic"].items()}
    where = plan.coordinates(layout, 5)
    inside, across = plan.node_split(layout, prediction, where, 4)
    assert (inside, across) == (traffic["ep"] * 3 // 15, traffic["dense"] + traffic["ep"] - traffic["ep"] * 3 // 15)
    assert plan.expert_nodes(c, layout, where, 4) == plan.ExpertNodes(nodes=4, near=3, peers=15, group_nodes=1,
                                                                      token_nodes=2)


def test_deepseek_v3_layout_puts_each_ep_rank_on_a_node_of_its_own():
    """DeepSeek-V3's layout (pp 16, ep 64, ZeRO-1 over dp 128 on 2048 GPUs) in mesh.py's order (tp fastest, then
    cp, pp, dp): a stage's ranks are 16 apart, so its ep group of 64 lies on 64 nodes, one rank on each, and
    all of its all-to-all crosses nodes; a group's 32 experts lie on 8 nodes and a token may reach 8, where
    DeepSeek-V3 places each group on one node of 8 GPUs (at most 4 nodes a token)."""
    args = cli.parse_args([*DEEPSEEK_V3, "--pp", "16", "--ep", "64", "--zero", "1", "--batch-size", "15360",
                           "--micro-batches", "120", "--dtype", "bfloat16", "--recompute", "full"])
    c = cli.model_config(args, cli.data_vocab_size(args))
    layout = plan.layout_of(args, 2048)
    where = plan.first_of_stage(layout, 5)
    assert plan.group_members(layout, where, ("ep",))[:3] == [5, 21, 37]
    assert plan.expert_nodes(c, layout, where, 8) == plan.ExpertNodes(nodes=64, near=0, peers=63, group_nodes=8,
                                                                      token_nodes=8)
    inside, across = plan.node_split(layout, plan.predict_stage(c, layout, 5), where, 8)
    assert inside == 0 and across > 0


# gpt-oss-20b and -120b whole (--arch gpt-oss): OpenAI's model card (its table 1) gives 20.91B parameters of which
# 3.61B active, and 116.83B of which 5.13B.
GPT_OSS_PUBLISHED = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}


def gpt_oss_parameters(c):
    """(a block's parameters besides its experts, an expert's), written out from gpt-oss's shapes: q, k and v
    (over n_kv_heads) and o, each with its bias, a sink per head, two RMSNorms, the router with its bias; an
    expert's gate | up and down, each with its bias."""
    q, kv = c.n_head * c.head_dim, c.n_kv_heads * c.head_dim
    attention = (c.d_model + 1) * (q + 2 * kv) + (q + 1) * c.d_model + c.n_head
    block = attention + 2 * c.d_model + (c.d_model + 1) * c.n_experts
    return block, (c.d_model + 1) * 2 * c.d_expert + (c.d_expert + 1) * c.d_model


@pytest.mark.parametrize("model", GPT_OSS_PUBLISHED)
def test_gpt_oss_presets_are_the_published_sizes_total_and_active(model):
    """The preset built by model.py (on the meta device, as the planner reads it) holds gpt-oss's parameters
    written out from its shapes: experts in every layer, windows on every second one from the first, untied
    embedding and head. Total and active within 0.5% of the model card's figures, active as the card counts
    it: what a token meets (its top-k experts of each layer, everything not an expert) with the unembedding
    (the output layer) but not the embedding, a table lookup. Its figures fix that reading: its 3.61B and
    5.13B are the blocks' active parameters and one table of 201,088 x 2,880 (1.16B for the two, its table
    says), and counting both tables would be over 10% more."""
    total, active = GPT_OSS_PUBLISHED[model]
    args = cli.parse_args(["--model", model, "--arch", "gpt-oss"])
    c = cli.model_config(args, cli.data_vocab_size(args))
    assert all(c.is_moe(layer) for layer in range(c.n_layer)) and not c.tie_embeddings
    assert c.window_layers == tuple(range(0, c.n_layer, 2)) and c.sliding_window and c.attention_sinks
    parameters = plan.model_parameters(plan.config_key(c))
    planned = sum(math.prod(shape) for _, shape in parameters)
    block, expert = gpt_oss_parameters(c)
    table = c.padded_vocab_size * c.d_model
    assert planned == c.n_layer * (block + c.n_experts * expert) + 2 * table + c.d_model
    idle = [name for name, _ in parameters if ".experts." in name and int(name.split(".")[4]) >= c.top_k]
    assert len(idle) == 4 * c.n_layer * (c.n_experts - c.top_k)  # (each expert's fc and proj, weight and bias)
    met = sum(math.prod(shape) for name, shape in parameters if name not in idle and name != "tok_emb.weight")
    assert abs(planned / total - 1) < 0.005 and abs(met / active - 1) < 0.005, (planned, met)
    assert (met + table) / active - 1 > 0.1


def test_gpt_oss_presets_need_their_architecture_and_keep_their_windows_in_fewer_layers():
    """--model gpt-oss-20b is the released model whole: refused in one line without --arch gpt-oss; with
    --layers N its first N blocks, its windowed ones (every second from the first) among them."""
    for arch in ("gpt", "llama", "deepseek"):
        plan_args, args = plan.parse_args(["--model", "gpt-oss-20b", "--arch", arch, "--world", "8", "--search"])
        with pytest.raises(cli.ConfigError, match="^--model gpt-oss-20b is gpt-oss's whole architecture: "
                                                  "add --arch gpt-oss$"):
            plan.search(args, plan_args)
    args = cli.parse_args(["--model", "gpt-oss-120b", "--arch", "gpt-oss", "--layers", "5"])
    c = cli.model_config(args, cli.data_vocab_size(args))
    assert (c.n_layer, c.window_layers) == (5, (0, 2, 4))


def test_search_fits_gpt_oss_20b_on_8_gpus_of_80_gb(capsys):
    """python -m tools.plan --model gpt-oss-20b --arch gpt-oss --search --world 8 (80 GB GPUs: 74.5 GiB, the
    stricter reading) names layouts that fit, all 8 ranks of them: the first one listed, planned alone, peaks
    within the GPU on every rank (start-up, a step, a checkpoint's load: what a GPU holds)."""
    plan_args, args = plan.parse_args(["--model", "gpt-oss-20b", "--arch", "gpt-oss", "--world", "8", "--search",
                                       "--memory", "80GB"])
    fits = plan.search(args, plan_args)
    assert fits and all(memory <= 80e9 for _, _, memory, _ in fits)
    first = fits[0][-1]
    assert (first.world, first.dp * first.tp * first.pp * first.cp) == (8, 8)
    (candidate,) = [flags for flags, layout in plan.candidate_layouts(args, 8, 8) if layout == first]
    peaks = plan.predict_peaks(candidate, 8)
    device = [max(peaks[f"{phase}_peak_bytes"][rank] for phase in ("startup", "step", "load")) - plan.PROCESS_BYTES
              for rank in range(8)]
    assert max(device) <= 80e9, device
    assert "layouts of gpt-oss-20b on 8 ranks fit 74.5 GiB" in capsys.readouterr().out


def test_plot_draws_the_planners_figures_from_the_file_the_benchmark_writes(tmp_path):
    """plot.py reads planner.json, not the planner: the figure's figures (planned_memory: busiest_memory of each
    strategy, mode and length) and, beside a measured point, predicted_for's prediction of its rank."""
    import plot
    planned = plan.planned_memory(seq_lens=(1024,))
    for label, world, flags in plan.STRATEGIES:
        base = ["--model", "mixtral", *plan.EXPERTS] if label.startswith("EP") else ["--model", "llama3-8b"]
        argv = plan.strategy_argv([*base, "--arch", "llama", "--dtype", "bfloat16"], flags, world, 1024, "full")
        assert planned["memory"]["full"][label] == [plan.busiest_memory(argv, world)]
    argv = ["--model", "tiny", "--zero", "3", "--batch-size", "2"]
    prediction = plan.predict(cli.parse_args(argv), 2)
    predicted = plan.predicted_for(argv, 2, 1)
    assert predicted["optim"] == prediction["optim_bytes"][1] and predicted["activations"] == (
        prediction["activation_peak_bytes"][1] + prediction["recompute_bytes"][1])
    points = [dict(strategy=label, seq_len=1024, recompute=mode, measured=predicted, predicted=predicted)
              for label, *_ in plan.STRATEGIES for mode in plan.figure.MODES]
    (tmp_path / "planner.json").write_text(json.dumps(dict(model="tiny", strategies=plan.STRATEGIES, points=points,
                                                           planned=planned)))
    plot.planned_memory(str(tmp_path))
    plot.measured_memory(str(tmp_path))
    assert (tmp_path / "memory_planned.png").stat().st_size > 0 and (tmp_path / "memory_measured.png").stat().st_size > 0
