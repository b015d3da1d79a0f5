"""Packed documents through every dimension: each layout trains as one device does in float64, on sequences
that hold several documents, with attention and positions stopping at every EOS and the prediction across it
left out of the loss.

The data is the synthetic language with one of its most frequent ids declared the EOS (--eos-id), so that the
documents' lengths vary freely: shorter than a context-parallel chunk, across every shard boundary, and longer
than a whole sequence (a row with no EOS at all). `test_the_data_covers_every_case` checks that they do.
"""
import json

import pytest
import torch

import train
from distributed import run_on_ranks
from model import document_ids
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan
from training import cli

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

EOS = "16"  # the synthetic language's most frequent id at the tiny preset: documents of about a dozen tokens
# A window of 6 tokens on every second layer (shorter than some documents, longer than others, crossing every
# cp=4 chunk boundary) and a sink on every head: each query sees what its document, its window and its sink
# leave it, through every way of splitting attention.
WINDOWS_AND_SINKS = ["--sliding-window", "6", "--window-layers", "1:1", "--attention-sinks"]
PACKED = [*EQUIVALENCE, "--seq-len", "32", "--document-mask", "--eos-id", EOS, *WINDOWS_AND_SINKS]
LLAMA = ["--arch", "llama", "--kv-heads", "2"]  # rotary positions restart at each document

DEEP = ["--layers", "4"]
WHOLE_HEADS = ["--arch", "llama", "--kv-heads", "4"]  # the all-to-all gives each of 4 ranks a whole key/value head

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    (2, [], ["--tp", "2"]),
    (2, LLAMA, ["--tp", "2", "--sp"]),
    (2, DEEP, ["--pp", "2", "--schedule", "1f1b"]),
    (2, [*LLAMA, *DEEP], ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--recompute", "full"]),
    (2, DEEP, ["--pp", "2", "--schedule", "zb1"]),
    (2, [*LLAMA, *DEEP, "--micro-batches", "4"], ["--pp", "2", "--schedule", "zbv"]),
    (2, [*LLAMA, "--experts", "4"], ["--ep", "2"]),
    (4, DEEP, ["--zero", "1", "--pp", "2", "--schedule", "gpipe"]),
    (2, [], ["--tp", "2", "--sp", "--recompute", "full"]),  # learned positions of a sequence shard, recomputed
    (2, LLAMA, ["--zero", "3", "--recompute", "selective"]),  # the core, run again, keeps its inputs' documents
    (4, [], ["--cp", "4", "--cp-mode", "ring"]),
    (4, LLAMA, ["--cp", "4", "--cp-mode", "allgather"]),
    (4, WHOLE_HEADS, ["--cp", "4", "--cp-mode", "alltoall"]),
    (4, LLAMA, ["--tp", "2", "--sp", "--cp", "2"]),
    (4, [*LLAMA, *DEEP], ["--pp", "2", "--schedule", "zbv", "--cp", "2"]),
    (4, [*WHOLE_HEADS, "--experts", "4"], ["--ep", "2", "--cp", "2", "--cp-mode", "alltoall"]),
]


def layout_id(world, model, flags):
    return "-".join(f.lstrip("-") for f in flags if f != "--schedule") + ("-llama" if LLAMA[0] in model else "")


def test_the_data_covers_every_case():
    """Documents shorter than a cp=4 chunk (4 tokens of 32) and rows that are one document cut from a longer
    one, boundaries inside chunks and on their edges, in the batches the equivalence runs train on."""
    args = cli.parse_args(PACKED)
    data, lengths, edges, whole_rows = train.load_training_data(args), [], set(), 0
    for step in range(args.steps):
        inputs = data.batch("train", step, args.batch_size, args.seq_len)[:, :-1]
        documents = document_ids(inputs, int(EOS))
        whole_rows += int((documents[:, -1] == 0).sum())
        for row in documents:
            lengths += torch.unique_consecutive(row, return_counts=True)[1].tolist()[1:-1]  # whole documents
            edges |= {i % 4 for i in range(1, len(row)) if row[i] != row[i - 1]}  # where in a chunk one starts
    assert min(lengths) < 4 and whole_rows > 0 and edges == {0, 1, 2, 3}


@pytest.mark.parametrize("world,model,flags", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_layouts_train_on_packed_documents_as_one_device(tmp_path, world, model, flags):
    argv = [*PACKED, *model, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=180):
        assert_matches_oracle(result, oracle([*PACKED, *model]))
    assert_matches_plan(tmp_path, argv, world)


def test_masking_needs_an_eos_id_inside_the_vocabulary():
    """--document-mask on data that declares no EOS (the synthetic language) needs --eos-id; an --eos-id the
    vocabulary does not have is refused; --no-document-mask wins over a declared EOS."""
    plain = [*EQUIVALENCE, "--document-mask"]
    with pytest.raises(cli.ConfigError, match="needs the id that ends each document: the synthetic language"):
        cli.check_args(cli.parse_args(plain), 1)
    with pytest.raises(cli.ConfigError, match="--eos-id 64 is not an id of the vocabulary of 64"):
        cli.check_args(cli.parse_args([*plain, "--eos-id", "64"]), 1)
    assert cli.document_eos(cli.parse_args([*PACKED, "--no-document-mask"])) is None
    assert cli.document_eos(cli.parse_args(EQUIVALENCE)) is None  # the synthetic language: one sequence each


def test_data_that_declares_its_eos_is_masked_by_default(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps(dict(dtype="uint16", vocab_size=64, eos_id=5)))
    assert cli.document_eos(cli.parse_args([*EQUIVALENCE, "--data", str(tmp_path)])) == 5
    assert cli.document_eos(cli.parse_args([*EQUIVALENCE, "--data", str(tmp_path), "--eos-id", "7"])) == 7
