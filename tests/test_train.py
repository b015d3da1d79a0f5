"""train.py end to end: refused flags, the run log, resuming, real data."""
import json

import pytest
import torch

import train
from distributed import run_on_ranks, torchrun
from oracle import assert_matches_oracle, reference_run, train_worker

QUICK = ["--model", "tiny", "--batch-size", "8", "--lr", "1e-2", "--log-interval", "1000"]


@pytest.mark.parametrize("world,flags,message", [
    (2, ["--pp", "2", "--zero", "3"], "--zero 3 with --pp is not supported"),
    (2, ["--tp", "3"], "world size 2 is not divisible by tp*pp*cp*ep = 3*1*1*1 = 3"),
    (3, ["--tp", "3"], "--tp 3: attention heads 4 does not divide by the tensor-parallel size 3"),
    (2, ["--sp"], "--sp (sequence parallelism) splits the sequence over the tensor-parallel group"),
    (2, ["--ep", "2", "--experts", "3"], "--experts 3 do not divide over --ep 2 ranks"),
    (4, ["--tp", "2", "--sp", "--seq-len", "15"], "sequence length (sequence parallelism) 15 does not divide"),
    (2, ["--experts", "4", "--zero", "1"], "--zero with --experts is not supported yet"),
    (1, ["--experts", "4", "--top-k", "5"], "--top-k 5 must be between 1 and --experts 4"),
    (2, ["--batch-size", "3"], "--batch-size 3 must divide into --micro-batches 1 x 2 data ranks"),
    (1, ["--micro-batches", "0"], "--micro-batches must be at least 1"),
])
def test_refused_flags_say_why(world, flags, message):
    with pytest.raises(train.ConfigError) as refusal:
        train.check_args(train.parse_args([*QUICK, *flags]), world)
    assert message in str(refusal.value)


@pytest.mark.parametrize("flags,message", [
    (["--sp"], "--sp (sequence parallelism) splits the sequence over the tensor-parallel group"),
    (["--batch-size", "3"], "--batch-size 3 must divide into --micro-batches 1 x 2 data ranks"),
])
def test_refused_flags_fail_fast_on_every_rank(tmp_path, flags, message):
    out = torchrun(2, "train.py", *QUICK, "--out", str(tmp_path), *flags, timeout=60)
    assert out.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}] train.py: error: {message}" in out.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written by a refused launch"


def test_two_rank_run_logs_every_field_and_approaches_the_floor(tmp_path):
    out = torchrun(2, "train.py", *QUICK, "--steps", "60", "--eval-interval", "20", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    run = tmp_path / "gpu2_tp1_pp1_cp1_ep1"
    config = json.loads((run / "config.json").read_text())
    floor = config["entropy_floor"]
    assert f"loss floor (entropy rate) {floor:.4f}" in out.stdout
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(60))
    params = list(train.build_model(train.model_config(train.parse_args(QUICK), 64), 0, torch.float32,
                                    torch.device("cpu")).parameters())
    n_params = sum(p.numel() for p in params)
    for entry in log:
        assert entry["tokens_per_s"] > 0 and entry["time_s"] > 0
        assert entry["param_bytes"] == entry["grad_bytes"] == [4 * n_params] * 2  # replicas: full copies
        # AdamW: two float32 moments per parameter and a float32 step counter per tensor.
        assert entry["optim_bytes"] == [8 * n_params + 4 * len(params)] * 2
        # Ring all-reduce of every gradient once per step: 2 (N-1)/N * 4 * n_params, N = 2.
        assert entry["comm_dp_all_reduce_bytes"] == [4 * n_params] * 2
        assert all(b > 0 for b in entry["activation_peak_bytes"])
        assert entry["comm_dp_reduce_scatter_bytes"] == [0, 0]
    val = {e["step"]: e["val_loss"] for e in log if "val_loss" in e}
    assert sorted(val) == [19, 39, 59]
    start = log[0]["loss"]
    # The loss falls most of the way from its start towards the entropy floor, and never below it.
    assert val[59] - floor < 0.25 * (start - floor)
    assert val[59] > floor
    assert (run / "checkpoint.pt").exists() and not (run / "checkpoint.pt.tmp").exists()


def test_stop_on_two_ranks_resume_on_one_continues_exactly(tmp_path):
    argv = [*QUICK, "--steps", "4", "--grad-clip", "0.05", "--dtype", "float64", "--eval-interval", "1000"]
    first = run_on_ranks(2, train_worker, [*argv, "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    checkpoint = tmp_path / "a" / "gpu2_tp1_pp1_cp1_ep1" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=True)["step"] == 2
    second = run_on_ranks(1, train_worker, [*argv, "--resume", str(checkpoint), "--out", str(tmp_path / "b")])[0]
    assert len(first["losses"]) == len(second["losses"]) == 2
    resumed = dict(losses=first["losses"] + second["losses"], state_dict=second["state_dict"])
    assert_matches_oracle(resumed, reference_run(argv))


def test_text_file_data_on_two_ranks_matches_single_device(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 40 + "the quick brown fox jumps over the lazy dog. ".encode() * 200)
    argv = [*QUICK, "--steps", "3", "--data", str(text), "--dtype", "float64", "--eval-interval", "1000"]
    results = run_on_ranks(2, train_worker, [*argv, "--out", str(tmp_path)])
    assert results[0]["state_dict"]["tok_emb.weight"].shape[0] == 256  # bytes are tokens
    assert results[0]["entropy_floor"] is None
    assert_matches_oracle(results[0], reference_run(argv))


def test_bfloat16_autocast_trains(tmp_path):
    argv = [*QUICK, "--steps", "3", "--eval-interval", "1000", "--out", str(tmp_path)]
    bf16 = run_on_ranks(1, train_worker, [*argv, "--dtype", "bfloat16"])[0]
    fp32 = run_on_ranks(1, train_worker, argv)[0]
    assert bf16["state_dict"]["lm_head.weight"].dtype == torch.float32  # weights stay float32
    # bf16 keeps ~3 significant digits: the losses agree to that, not exactly.
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0)
    assert bf16["losses"] != fp32["losses"]  # autocast really ran in bfloat16
