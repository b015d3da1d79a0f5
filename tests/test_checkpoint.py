"""Sharded checkpoints (training/checkpoint.py): each rank writes its pieces once, a checkpoint is complete only with
its manifest, damaged files are told apart, any layout resumes exactly, and one safetensors file in
model.py's layout converts to and from it."""
import json
import os
from datetime import timedelta

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from training import checkpoint
import tp
from training.checkpoint import Checkpoint, Piece
from tools import convert
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker

MOE = ["--experts", "4", "--top-k", "2"]


# -- training/checkpoint.py on its own ------------------------------------------------------------------

def save_toy_checkpoints(run_dir, steps, keep):
    """Two ranks save a toy state: a weight split in two along dim 1 (each rank its part, both in two
    pieces) and a bias both hold whole (one copy written); the checkpoint of step s holds s + values."""
    saver = checkpoint.Saver(dist.new_group(backend="gloo", timeout=timedelta(seconds=60)))
    rank = dist.get_rank()
    weight = torch.arange(24, dtype=torch.float64).view(4, 6)
    layouts = dict(weight=dict(shape=[4, 6], dtype="F64", split=dict(dim=1, blocks=None, parts=2)),
                   bias=dict(shape=[3], dtype="F32", split=None))
    for step in steps:
        mine = tp.shard(weight + step, 1, rank, 2).reshape(-1)
        pieces = [(Piece("weight", "model", rank, 0, 5), mine[:5]), (Piece("weight", "model", rank, 5, 12), mine[5:]),
                  (Piece("weight", "exp_avg", rank, 0, 12), -mine),
                  (Piece("bias", "model", 0, 0, 3), torch.full((3,), float(step)))]
        saver.save(checkpoint.path_for(run_dir, step), pieces, layouts,
                   dict(step=step, skipped_steps=0, args={}, steps=dict(weight=float(step))), keep)
    saver.wait()
    return sorted(os.listdir(checkpoint.path_for(run_dir, steps[-1])))


def test_each_piece_is_written_once_and_read_back_under_any_split(tmp_path):
    files = run_on_ranks(2, save_toy_checkpoints, tmp_path, [1, 2, 3], 2)[0]
    assert files == ["manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert [os.path.basename(p) for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-00000003",
                                                                              "checkpoint-00000002"]
    saved = Checkpoint(checkpoint.path_for(tmp_path, 3))
    weight = torch.arange(24, dtype=torch.float64).view(4, 6) + 3
    assert torch.equal(saved.full("weight"), weight) and torch.equal(saved.full("weight", "exp_avg"), -weight)
    assert torch.equal(saved.full("bias"), torch.full((3,), 3.0))
    assert saved.optimizer_keys("weight") == ["exp_avg"] and saved.steps == dict(weight=3.0)
    assert sum(p["name"] == "bias" for p in saved.manifest["pieces"]) == 1  # both ranks held it: written once
    picked = torch.tensor([23, 0, 7, 12])  # any elements, in any order
    assert torch.equal(saved.read("weight", "model", picked), weight.view(-1)[picked])
    for file in files[1:]:  # each rank's file is a safetensors file any reader opens
        ours = checkpoint.SafetensorsFile(tmp_path / "checkpoint-00000003" / file)
        for entry, value in safetensors.torch.load_file(tmp_path / "checkpoint-00000003" / file).items():
            assert torch.equal(ours.tensor(entry), value)


def test_incomplete_and_damaged_checkpoints_are_told_apart_and_skipped(tmp_path):
    run_on_ranks(2, save_toy_checkpoints, tmp_path, [1, 2, 3], 3)
    newest, previous = checkpoint.path_for(tmp_path, 3), checkpoint.path_for(tmp_path, 2)
    file = os.path.join(newest, "rank-00001.safetensors")
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    open(file, "wb").write(bytes(data))
    with pytest.raises(checkpoint.BadCheckpoint, match="damaged, the bytes of rank-00001.safetensors"):
        checkpoint.verify(newest)
    checkpoint.verify(newest, share=(0, 2))  # the share of files one of two ranks hashes: not this one
    reports = []
    assert checkpoint.newest_good(tmp_path, reports.append) == previous
    assert reports == [f"skipping checkpoint {newest}: damaged, the bytes of rank-00001.safetensors do not "
                       f"match its SHA-256"]
    with open(os.path.join(previous, "rank-00000.safetensors"), "r+b") as f:
        f.truncate(100)  # as by a full disk
    with pytest.raises(checkpoint.BadCheckpoint, match="damaged, rank-00000.safetensors is not of its size"):
        checkpoint.complete(previous)
    with open(os.path.join(previous, "manifest.json"), "w") as f:
        f.write('{"step": 2, "files": ')  # a manifest damaged after it was written whole
    with pytest.raises(checkpoint.BadCheckpoint, match="damaged, its manifest.json is not readable"):
        checkpoint.complete(previous)
    os.remove(os.path.join(checkpoint.path_for(tmp_path, 1), "manifest.json"))  # as if killed before it
    with pytest.raises(checkpoint.BadCheckpoint, match="incomplete, its write never finished"):
        Checkpoint(checkpoint.path_for(tmp_path, 1))
    assert checkpoint.newest_good(tmp_path, reports.append) is None


@pytest.mark.parametrize("shape,dim,blocks,parts", [((6, 4), 0, None, 2), ((4, 6), 1, None, 3),
                                                    ((12, 2), 0, [8, 2, 2], 2), ((2, 3, 8), 2, [4, 4], 2)])
def test_in_parts_is_where_tp_shard_puts_each_element(shape, dim, blocks, parts):
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    kept = torch.cat([tp.shard(full, dim, t, parts, blocks).reshape(-1) for t in range(parts)])
    positions = torch.arange(full.numel())
    where = checkpoint.in_parts(positions, shape, dict(dim=dim, blocks=blocks, parts=parts))
    assert torch.equal(kept[where], positions)


# -- a run's checkpoints -----------------------------------------------------------------------

def test_zero3_on_dp4_resumes_exactly_on_tp2_pp2(tmp_path):
    # (with attention sinks: ZeRO-3's flat shards of them resumed as tp's split by heads)
    argv = [*EQUIVALENCE, "--steps", "4", "--layers", "4", "--attention-sinks"]
    first = run_on_ranks(4, train_worker, [*argv, "--zero", "3", "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    saved = tmp_path / "a" / "gpu4_tp1_pp1_cp1_ep1" / "checkpoint-00000002"
    second = run_on_ranks(4, train_worker, [*argv, "--tp", "2", "--pp", "2", "--resume", str(saved),
                                            "--out", str(tmp_path / "b")])
    for result in second:
        assert_matches_oracle(dict(losses=first["losses"] + result["losses"], state_dict=result["state_dict"]),
                              reference_run(argv))


def test_a_zbv_checkpoint_resumes_exactly_on_a_plain_pipeline(tmp_path):
    """ZB-V's V (rank 0 holds the first and the last chunk, rank 1 the two middle ones) with ZeRO-1 on two
    data ranks writes its pieces under the model's names, so four plain stages read them back."""
    argv = [*EQUIVALENCE, "--steps", "4", "--layers", "4"]
    first = run_on_ranks(4, train_worker, [*argv, "--pp", "2", "--schedule", "zbv", "--zero", "1", "--stop-at", "2",
                                           "--out", str(tmp_path / "a")])[0]
    saved = tmp_path / "a" / "gpu4_tp1_pp2_cp1_ep1" / "checkpoint-00000002"
    second = run_on_ranks(4, train_worker, [*argv, "--pp", "4", "--resume", str(saved), "--out", str(tmp_path / "b")])
    for result in second:
        assert_matches_oracle(dict(losses=first["losses"] + result["losses"], state_dict=result["state_dict"]),
                              reference_run(argv))


def killed_while_saving(argv, step, rank):
    """train.py's training, this process dying (as by SIGKILL) halfway through writing its file of the
    checkpoint of `step`, on `rank`."""
    write = checkpoint.write_safetensors

    def dies_halfway(path, entries, metadata=None):
        if dist.get_rank() == rank and f"checkpoint-{step:08d}" in str(path):
            with open(path + ".tmp", "wb") as f:
                f.write(b"\0" * 1000)
            os._exit(9)
        return write(path, entries, metadata)

    checkpoint.write_safetensors = dies_halfway
    return train_worker(argv)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_the_newest_good_one(tmp_path):
    argv = [*EQUIVALENCE, "--steps", "6", "--checkpoint-interval", "1", "--resume", "auto", "--timeout", "20",
            "--out", str(tmp_path)]
    with pytest.raises(RuntimeError, match="exited with code 9"):
        run_on_ranks(2, killed_while_saving, argv, 3, 0)  # rank 0 writes all: no ZeRO, replicas
    run = tmp_path / "gpu2_tp1_pp1_cp1_ep1"
    reports = []
    assert checkpoint.newest_good(run, reports.append) == checkpoint.path_for(run, 2)
    assert reports == [f"skipping checkpoint {checkpoint.path_for(run, 3)}: incomplete, its write never finished "
                       f"(no manifest.json)"]
    resumed = run_on_ranks(2, train_worker, argv)[0]
    assert len(resumed["losses"]) == 4  # from step 2
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(6))
    assert_matches_oracle(dict(losses=[e["loss"] for e in log], state_dict=resumed["state_dict"]),
                          oracle([*EQUIVALENCE, "--steps", "6"]))


# -- conversion --------------------------------------------------------------------------------

def test_a_checkpoint_converts_to_one_file_and_back_exactly(tmp_path):
    """tp=2 pp=2 ep=2 with ZeRO-1 -> one safetensors file (model.py's state dict, which safetensors reads, and
    the optimizer's state) -> a checkpoint again -> the same file, byte for byte; and a run resumed from the
    imported checkpoint on one rank continues exactly."""
    argv = [*EQUIVALENCE, *MOE, "--steps", "3", "--layers", "4"]
    run_on_ranks(8, train_worker, [*argv, "--tp", "2", "--pp", "2", "--ep", "2", "--zero", "1", "--stop-at", "2",
                                   "--out", str(tmp_path / "a")], timeout=300)
    saved = tmp_path / "a" / "gpu8_tp2_pp2_cp1_ep2" / "checkpoint-00000002"
    exported = tmp_path / "model.safetensors"
    convert.main(["to-file", str(saved), str(exported)])
    plain = safetensors.torch.load_file(exported)
    model_state = Checkpoint(saved).model_state()
    assert {name: plain[name] for name in model_state}.keys() == model_state.keys()
    for name, value in model_state.items():
        assert torch.equal(plain[name], value), name
    assert plain["optimizer.exp_avg.tok_emb.weight"].shape == model_state["tok_emb.weight"].shape
    imported = convert.import_file(exported, tmp_path / "b")
    assert os.path.basename(imported) == "checkpoint-00000002"
    again = tmp_path / "again.safetensors"
    convert.main(["to-file", imported, str(again)])
    assert again.read_bytes() == exported.read_bytes()
    resumed = run_on_ranks(1, train_worker, [*argv, "--resume", imported, "--out", str(tmp_path / "c")])[0]
    reference = reference_run(argv)
    torch.testing.assert_close(resumed["losses"], reference["losses"][2:], rtol=1e-9, atol=1e-12)
    assert_matches_oracle(dict(losses=reference["losses"], state_dict=resumed["state_dict"]), reference)
    weights = tmp_path / "weights.safetensors"
    convert.main(["to-file", str(saved), str(weights), "--weights-only"])
    assert safetensors.torch.load_file(weights).keys() == model_state.keys()
