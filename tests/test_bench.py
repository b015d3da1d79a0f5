"""python -m tools.bench --quick and plot.py regenerate the results from nothing (on a subset, to stay quick)."""
import json
import subprocess
import sys

import pytest

from distributed import REPO

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full


def test_quick_benchmark_writes_summary_comparisons_figures_and_table(tmp_path):
    only = ["gpu1_tp1_pp1_cp1_ep1", "gpu2_tp1_pp1_cp1_ep1", "ddp", "scaling"]
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--peak-tflops", "0.001", "--out", str(tmp_path),
                          "--only", *only],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["name"] for r in rows] == only[:2]
    single, dp2 = rows
    assert single["efficiency"] == 1.0 and single["ceiling_tokens_per_s"] == single["tokens_per_s"]
    for row in rows:  # model FLOPs utilisation against the given peak, 1 GFLOP/s a rank
        assert row["mfu"] == row["model_flops_per_s"] / (row["world"] * 1e9) > 0
    machine = json.loads((tmp_path / "machine.json").read_text())
    assert dp2["ceiling_tokens_per_s"] == single["tokens_per_s"] * min(2, machine["cores"])
    check = machine["scaling"]  # its efficiency is each round's n-rank throughput over n times 1 rank's
    (round_,) = check["per_round"]
    assert check["ranks"] == min(2, machine["cores"])
    assert check["efficiency"] == round_["efficiency"] == round_["data_parallel"] / (check["ranks"] * round_["one_rank"])
    assert check["machine_scaling"] == round_["independent"] / (check["ranks"] * round_["one_rank"])
    assert abs(dp2["final_val_loss"] - single["final_val_loss"]) < 1e-4  # the same training, in float32
    assert dp2["comm_bytes_per_step"]["dp"] > 0 and single["comm_bytes_per_step"].get("dp", 0) == 0
    comparison = json.loads((tmp_path / "comparisons.json").read_text())["ddp"]
    assert comparison["ours_step_s"] > 0 and comparison["builtin_step_s"] > 0
    for ratio in ("ratio", "over_no_communication"):  # medians of per-round ratios, inside their range
        low, high = comparison[f"{ratio}_range"]
        assert low <= comparison[ratio] <= high
    assert comparison["max_loss_difference"] < 1e-4  # they compute the same thing, in float32

    plot = subprocess.run([sys.executable, "plot.py", "--results", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr[-3000:]
    for figure in ("throughput", "loss", "memory", "communication", "bubble", "experts"):
        assert (tmp_path / f"{figure}.png").stat().st_size > 1000
    table = (tmp_path / "results.md").read_text()
    assert "| Run | Parallelism | Avg Tok/Sec | Final Val Loss |" in table
    assert "| gpu2_tp1_pp1_cp1_ep1 | DP=2 |" in table and "DistributedDataParallel" in table
    assert f"data parallelism on {check['ranks']} ranks reaches {check['efficiency']:.0%}" in table
    assert f"takes {comparison['over_no_communication']:.2f}x" in table


def test_quick_documents_row_times_document_masking_against_plain_causal(tmp_path):
    """--only documents: per document length distribution, train.py with and without --document-mask in turn,
    and the attention core alone; ratios are the medians of per-round ratios, inside their range."""
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--out", str(tmp_path), "--only", "documents"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "documents.json").read_text())
    assert set(result["rows"]) == {"short", "long"}  # --quick's two; the full run adds "half"
    for name, row in result["rows"].items():
        # the data written holds documents of the asked mean length: 1 / (mean in sequences) a sequence
        assert abs(row["documents_per_sequence"] * row["mean_document_sequences"] - 1) < 0.1, name
        for ratio in ("step_time", "attention_time"):
            low, high = row[f"{ratio}_range"]
            assert low <= row[f"{ratio}_ratio"] <= high
        assert row["tokens_per_s"]["documents"] > 0 and row["attention_s"]["documents"] > 0
    for name in result["rows"]:  # both arms trained on the same tokens, the mask changing what they learn
        causal, masked = ([json.loads(line) for line in open(tmp_path / "documents" / "runs" / f"{name}-{arm}0" /
                                                           "log.jsonl")] for arm in ("causal", "documents"))
        assert causal[-1]["tokens_seen"] == masked[-1]["tokens_seen"] and causal[0]["loss"] != masked[0]["loss"]
    long = json.loads((tmp_path / "long_sequences.json").read_text())  # --quick's: documents and a window
    assert len(long["rows"]) == 2 and [row.get("window") for row in long["rows"].values()] == [None, 64]
    for row in long["rows"].values():
        low, high = row["speed_range"]
        assert low <= row["speed_ratio"] <= high and min(row["peak_resident_bytes"].values()) > 0


def test_quick_fp8_trains_each_recipe_beside_bfloat16_on_the_same_batches(tmp_path):
    """--only fp8: bfloat16 and each recipe from the same weights on the same batches: their first losses differ
    only by the float8 products' rounding, their final losses are the means of the last steps' logged."""
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--out", str(tmp_path), "--only", "fp8"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "fp8.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["bfloat16", "rowwise", "tensorwise"] and "cuda" not in result  # no GPU here
    for arm, row in arms.items():
        assert len(row["losses"]) == 12 and row["final_loss"] == sum(row["losses"][-4:]) / 4
        if arm != "bfloat16":
            assert row["losses"][0] != arms["bfloat16"]["losses"][0]  # float8 computed this one
            assert abs(row["losses"][0] - arms["bfloat16"]["losses"][0]) < 0.05 * arms["bfloat16"]["losses"][0]
    assert "fp8 rowwise" in run.stdout and "fp8 tensorwise" in run.stdout


def test_quick_zero_pipeline_sets_zero3_beside_zero1_under_1f1b(tmp_path):
    """--only zero_pipeline: train.py with --zero 1 and --zero 3 under 1F1B (pp 2 x dp 2), in turn in each round in
    the same processes; per rank the logged memory and bytes, as dp.py's docstring has them."""
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--out", str(tmp_path), "--only",
                          "zero_pipeline"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "zero_pipeline.json").read_text())
    world, n = result["ranks"], result["dp"]
    assert (world, result["pp"], n, result["schedule"]) == (4, 2, 2, "1f1b")
    assert len(result["per_round"]) == result["rounds"] > 1
    for r in range(result["rounds"]):  # both arms ran every round, every step logged by all four ranks
        for arm in ("zero1", "zero3"):
            folder = tmp_path / "zero_pipeline" / "runs" / f"{arm}_{r}"
            config = json.loads((folder / "config.json").read_text())
            assert (config["world"], config["args"]["zero"], config["args"]["pp"]) == (world, int(arm[-1]), 2)
            log = [json.loads(line) for line in open(folder / "log.jsonl")]
            assert [e["step"] for e in log] == list(range(result["steps"]))
            assert all(len(e["peak_resident_bytes"]) == world and min(e["peak_resident_bytes"]) > 0 for e in log)
    low, high = result["step_time_range"]  # the median of per-round ratios, inside their range
    assert low <= result["step_time_ratio"] <= high
    assert [min(r["ratio"] for r in result["per_round"]), max(r["ratio"] for r in result["per_round"])] == [low, high]
    firsts = [next(iter(r["start_resident_bytes"])) for r in result["per_round"]]  # the arms in the order they ran
    assert firsts == ["zero1", "zero3", "zero1"][:result["rounds"]]  # rotated every round
    assert result["max_loss_difference"] < 1e-6  # the same training, in float32
    one, three = (result["arms"][arm]["per_rank"] for arm in ("zero1", "zero3"))
    for rank in range(world):
        # After the step ZeRO-3 keeps only its shard of the weights (the optimizer's copy); ZeRO-1 the full
        # weights, its shard being a view of them; the optimizer state is sharded alike.
        assert (three["param_bytes"][rank] + three["optim_bytes"][rank]
                < one["param_bytes"][rank] + one["optim_bytes"][rank])
        assert three["param_bytes"][rank] * n == one["param_bytes"][rank]
        assert three["grad_bytes"][rank] < one["grad_bytes"][rank]
        for arm in (one, three):  # VmHWM, from a reset at the run's start: the resident memory then, and the rise
            low, high = arm["peak_above_start_range"][rank]
            assert arm["peak_resident_bytes"][rank] > arm["start_resident_bytes"][rank] > 0
            assert low <= arm["peak_above_start_bytes"][rank] <= high
        # dp.py: under a pipeline ZeRO-3 gathers each unit once per step and reduce-scatters it once, as ZeRO-1
        # reduce-scatters its buckets and all-gathers them. Both pad each bucket (ZeRO-1's: one per stage here,
        # ZeRO-3's: one per unit) to a multiple of N = 2, and every unit of tiny holds an even number of elements:
        # the same padding, so the same bytes, (N-1)/N of the stage's weights each.
        assert one["comm_dp_reduce_scatter_bytes"][rank] == three["comm_dp_reduce_scatter_bytes"][rank] > 0
        assert one["comm_dp_all_gather_bytes"][rank] == three["comm_dp_all_gather_bytes"][rank] > 0
        assert three["comm_dp_all_gather_bytes"][rank] == (n - 1) * one["param_bytes"][rank] // n
        assert one["comm_dp_all_reduce_bytes"][rank] == three["comm_dp_all_reduce_bytes"][rank]  # the clip's norm
        assert one["comm_pp_send_recv_bytes"][rank] == three["comm_pp_send_recv_bytes"][rank] > 0
    import plot  # results.md's paragraph and table of it
    table = "\n".join(plot.zero_pipeline_lines(result))
    assert f"ZeRO-3's step takes {result['step_time_ratio']:.2f}x ZeRO-1's" in table
    assert table.count("\n| ZeRO-") == 2


def consolidated_worker(out):
    """bench's checkpoint comparison, small: train a step under ZeRO-3, save the consolidated file, and resume
    a Trainer from it through ConsolidatedFile as the comparison does; whether the state is the same."""
    import torch
    import train
    from mesh import Mesh
    from tools import bench
    from training import checkpoint, cli
    args = cli.parse_args(["--model", "tiny", "--zero", "3", "--batch-size", "4", "--steps", "1", "--out", out])
    config, shape = cli.check_args(args, 2)
    mesh, data, device = Mesh(shape), train.load_training_data(args), torch.device("cpu")
    trainer = train.Trainer(args, config, mesh, data, device)
    trainer.train_step(0)
    path = f"{out}/consolidated.pt"
    bench.save_consolidated(trainer, path)
    torch.distributed.barrier()  # rank 0 writes the file after the others are done (as bench's _phase waits)
    args.resume, original = path, checkpoint.Checkpoint
    checkpoint.Checkpoint = bench.ConsolidatedFile
    try:
        resumed = train.Trainer(args, config, mesh, data, device)
    finally:
        checkpoint.Checkpoint = original
    return bench.fingerprint(resumed) == bench.fingerprint(trainer)


def test_a_consolidated_checkpoint_resumes_a_trainer_as_the_comparison_reads_it(tmp_path):
    """The checkpoint comparison (`--only checkpoint`, too long for the suite) reads its consolidated file
    through an object standing in for checkpoint.Checkpoint: it must offer what train.Trainer reads."""
    from distributed import run_on_ranks
    assert run_on_ranks(2, consolidated_worker, str(tmp_path)) == [True, True]


def muon_worker(flags):
    """bench's Muon timing (worker_muon), tiny: AdamW and Muon's two assemblies stepped in turn on these ranks."""
    from tools import bench
    settings = dict(bench.QUICK, flags=flags, dtype="float32")
    return bench.worker_muon(settings)


def test_muon_timing_steps_adamw_and_both_assemblies_and_reads_their_logged_bytes():
    """--only muon's worker on 4 ranks under ZeRO-1 (dp 4), tiny: every arm timed in every round after the
    warm-up; the two assemblies give the same losses, Muon's bytes (the logged comm_optim_all_to_all_bytes) are
    sent by Muon alone, and here every holder gathering each matrix sends more of them than one owner assembling
    it (not a law: a matrix split unevenly between two holders costs the owner twice the other's piece, the
    gather both pieces once)."""
    from distributed import run_on_ranks
    from tools import bench
    results = run_on_ranks(4, muon_worker, ["--zero", "1"])
    assert all(r == results[0] for r in results[1:])  # (the slowest rank's times: the same on every rank)
    measured = results[0]
    assert list(measured) == ["adamw", "owner", "gather"]
    for arm in measured.values():
        assert len(arm["step_s"]) == len(arm["optimizer_s"]) == bench.QUICK["muon"]["rounds"]
        assert all(0 < o < s for o, s in zip(arm["optimizer_s"], arm["step_s"]))
        assert len(arm["last_step"]["comm_optim_all_to_all_bytes"]) == 4
    sent = {arm: m["last_step"]["comm_optim_all_to_all_bytes"] for arm, m in measured.items()}
    assert sent["adamw"] == [0] * 4 and min(sent["owner"]) > 0
    assert sum(sent["gather"]) > sum(sent["owner"])
    assert measured["owner"]["losses"] == measured["gather"]["losses"] != measured["adamw"]["losses"]
    # Muon keeps one momentum a matrix element where AdamW keeps two moments
    assert sum(measured["owner"]["last_step"]["optim_bytes"]) < sum(measured["adamw"]["last_step"]["optim_bytes"])


def test_quick_moe_overlap_reads_the_exchanges_from_every_ranks_trace(tmp_path):
    """--only moe_overlap: ep 2 under pp 2 with the all-to-alls in chunks, whole beside a paired micro-batch (its
    forward in a thread of its own, traced too), and waited for, each traced on all four ranks; the overlapping
    arms' traces pair every exchange's start with its wait (forward and backward), the waited arm's has none,
    and all train the same."""
    from tools.bench.moe_overlap import overlapped_fraction
    run = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--out", str(tmp_path), "--only",
                          "moe_overlap"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "moe_overlap.json").read_text())
    assert result["max_loss_difference"] < 1e-6  # the same training, in float32
    for arm, chunks in (("overlapped", 4), ("paired", 1), ("waited", 0)):
        traces = sorted((tmp_path / "moe_overlap" / f"{arm}_0" / "traces").glob("rank*.json"))
        assert len(traces) == 4
        for path in traces:
            events = json.loads(path.read_text())["traceEvents"]
            names = {e["name"] for e in events if str(e.get("name", "")).startswith("ep.")}
            exchanged = {f"ep.{kind} c{c}{grad} {mark}" for kind in ("dispatch", "combine") for c in range(chunks)
                         for grad in ("", " grad") for mark in ("start", "wait")}
            assert exchanged <= names and (chunks or not any(n.endswith(" wait") for n in names))
            in_flight, waited = overlapped_fraction(events)
            assert (in_flight > 0) == bool(chunks) and 0 <= waited <= in_flight
        if arm == "paired":  # the last stage's forwards of micro-batches 1-3 ran in the pairs' second threads
            events = json.loads(traces[-1].read_text())["traceEvents"]
            threads = {e["tid"] for e in events if e.get("ph") == "X" and e.get("name") == "ep.dispatch c0 start"}
            assert len(threads) > 1
    for arm in ("overlapped", "paired"):
        assert 0 < result[arm]["fraction"] <= 1 and result["per_round"][0]["waited"]["fraction"] == 0
