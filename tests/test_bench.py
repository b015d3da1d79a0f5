"""tools/bench.py --quick and plot.py regenerate the results from nothing (on a subset, to stay quick)."""
import json
import subprocess
import sys

from distributed import REPO


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
