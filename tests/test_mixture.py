"""Weighted mixtures of token directories (--data A:0.7,B:0.3, or a JSON file of them): each sequence's source
is drawn by weight from (seed, split, step, its index), so the shares follow the weights, every layout and
every resume reads the same tokens, and each step's log record says how many came from each source.

The two sources hold ids of their own (A below 32, B from 32), so a sequence tells where it came from.
"""
import json
import os

import numpy as np
import pytest
import torch

from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from training import cli
from training.data import DataInfo, Mixture, TokenFile, open_data

VOCAB = 64


def token_folder(path, ids, eos_id=None, tokenizer=None, vocab_size=VOCAB):
    """A token directory as tools/prepare.py writes one: train.bin, val.bin (the last fifth) and meta.json."""
    os.makedirs(path)
    ids = np.asarray(ids, dtype=np.uint16)
    cut = len(ids) * 4 // 5
    ids[:cut].tofile(os.path.join(path, "train.bin"))
    ids[cut:].tofile(os.path.join(path, "val.bin"))
    meta = dict(dtype="uint16", vocab_size=vocab_size, eos_id=eos_id, tokenizer=tokenizer and "tok",
                tokenizer_sha256=tokenizer)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    return dict(a=token_folder(root / "a", rng.integers(0, 32, 3000)),
                b=token_folder(root / "b", rng.integers(32, 64, 2000)), root=root)


def test_each_sources_share_follows_its_weight(sources):
    """Over 4,000 sequences the shares are 0.7 and 0.3 within 0.03: a binomial share's standard deviation is
    sqrt(0.7 * 0.3 / 4000) = 0.0072, so 0.03 is four of them. Each row is a window of its own source."""
    mixture = open_data(DataInfo.read(f"{sources['a']}:0.7,{sources['b']}:0.3"))
    a_rows = 0
    for step in range(500):
        batch = mixture.batch("train", step, 8, 16)
        from_a = (batch < 32).all(1)
        assert (from_a | (batch >= 32).all(1)).all(), "a row mixes two sources"
        a_rows += int(from_a.sum())
    assert abs(a_rows / 4000 - 0.7) < 0.03
    seen = mixture.log(499, 8, 16)["tokens_seen_by_source"]
    assert seen == {sources["a"]: a_rows * 16, sources["b"]: (4000 - a_rows) * 16}


def test_a_sources_rows_are_those_it_gives_alone(sources):
    """The rows a source gives in a batch are its own windows for that step, as it would draw them alone."""
    mixture = open_data(DataInfo.read(f"{sources['a']}:1,{sources['b']}:3"))
    step = next(s for s in range(20) if len(set(mixture.picks("train", s, 8))) == 2)  # both sources in it
    picks, batch = mixture.picks("train", step, 8), mixture.batch("train", step, 8, 16)
    for k, name in enumerate(["a", "b"]):
        alone = TokenFile(sources[name]).batch("train", step, int((picks == k).sum()), 16)
        assert torch.equal(batch[torch.from_numpy(picks == k)], alone)


def test_a_json_file_names_the_same_mixture(sources):
    root = sources["root"]
    (root / "mix.json").write_text(json.dumps({"a": 0.7, "b": 0.3}))  # paths relative to the file's folder
    by_file = open_data(DataInfo.read(str(root / "mix.json")))
    by_flag = open_data(DataInfo.read(f"{sources['a']}:0.7,{sources['b']}:0.3"))
    assert isinstance(by_file, Mixture)
    assert torch.equal(by_file.batch("train", 3, 8, 16), by_flag.batch("train", 3, 8, 16))


def test_sources_that_do_not_share_a_vocabulary_or_a_weight_are_refused(sources, tmp_path):
    other = token_folder(tmp_path / "other", np.arange(100), vocab_size=128)
    for spec, message in [(f"{sources['a']}:0.7,{other}:0.3", "vocabulary"),
                          (f"{sources['a']}:0.7,{token_folder(tmp_path / 'eos', np.arange(100), eos_id=3)}:1",
                           "EOS id"),
                          (f"{sources['a']}:0.7,{token_folder(tmp_path / 't', np.arange(100), tokenizer='x')}:1",
                           "tokenizer"),
                          (f"{sources['a']}:0,{sources['b']}:1", "weight 0.0 is not a positive number"),
                          (f"{sources['a']}:x,{sources['b']}:1", "is not a positive number"),
                          (f"{sources['a']}:0.7,{tmp_path / 'missing'}:1", "no such file")]:
        with pytest.raises(cli.ConfigError, match=message):
            cli.describe_data(cli.parse_args(["--data", spec]))


MIXED = [*EQUIVALENCE, "--steps", "4"]


def read_log(folder):
    (run,) = os.listdir(folder)
    with open(os.path.join(folder, run, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("world,flags", [(2, ["--tp", "2", "--sp"]), (2, ["--pp", "2", "--zero", "1"])],
                         ids=["tp2-sp", "pp2-zero1"])
def test_a_mixture_trains_as_one_device_and_logs_the_same_shares(sources, tmp_path, world, flags):
    argv = [*MIXED, "--data", f"{sources['a']}:0.7,{sources['b']}:0.3"]
    for result in run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=180):
        assert_matches_oracle(result, oracle(argv))
    mixture = open_data(cli.describe_data(cli.parse_args(argv)))
    args = cli.parse_args(argv)
    seen = {}
    for entry in read_log(tmp_path):  # each step's running sum, from the batches each source gave
        for k, name in enumerate(mixture.names):
            seen[name] = seen.get(name, 0) + int((mixture.picks("train", entry["step"], args.batch_size) == k).sum()
                                                 ) * args.seq_len
        assert entry["tokens_seen_by_source"] == seen
        assert sum(seen.values()) == entry["tokens_seen"]


def test_a_resumed_mixture_reads_and_logs_as_one_run(sources, tmp_path):
    """Stopped after step 2 and resumed on another layout: the same losses and weights as one run, and the
    log's per-source counts go on from where they were."""
    argv = [*MIXED, "--data", f"{sources['a']}:0.5,{sources['b']}:0.5"]
    first = run_on_ranks(2, train_worker, [*argv, "--tp", "2", "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    (run,) = os.listdir(tmp_path / "a")
    saved = tmp_path / "a" / run / "checkpoint-00000002"
    second = run_on_ranks(2, train_worker, [*argv, "--pp", "2", "--resume", str(saved),
                                            "--out", str(tmp_path / "b")])[0]
    assert_matches_oracle(dict(losses=first["losses"] + second["losses"], state_dict=second["state_dict"]),
                          oracle(argv))
    whole = open_data(cli.describe_data(cli.parse_args(argv)))
    for entry in read_log(tmp_path / "a") + read_log(tmp_path / "b"):
        assert entry["tokens_seen_by_source"] == whole.log(entry["step"], 8, 16)["tokens_seen_by_source"]
