"""docs/own-text.md's worked example, end to end on a tiny model: a Hugging Face folder (a Mixtral: experts for ep,
heads for tp, layers for pp) and a folder of text -> python -m tools.prepare -> train.py --init-from under
tp=2, pp=2 and ep=2 -> python -m tools.sample -> python -m tools.convert to-hf -> python -m tools.sample again.

Each layout trains as one device does in float64 (tests/oracle.py's loop, on the same folder and token
directory), and each resumes another's checkpoint exactly. The greedy continuation printed from every
checkpoint, and from the exported folder with the tokenizer it carries, is model.py's greedy decoding on the
single device's final weights, token for token.
"""
import pytest
import torch

import hf_models
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from texts import documents, greedy, run, tokenizer_folder, write_documents
from tools import sample
from training import cli
from training.checkpoint import TORCH_DTYPES, Checkpoint
from training.tokenizer import Tokenizer

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"], "ep": ["--ep", "2"]}
RESUMED_ON = {"tp": "pp", "pp": "ep", "ep": "tp"}  # each layout's step-2 checkpoint, resumed on another
STEPS = ["--steps", "4", "--checkpoint-interval", "2", "--seq-len", "16"]
PROMPT, NEW = "the cat sat on", 12


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """{model, tokenizer, data, argv}: the folders a user starts from, the token directory prepared from the
    text, and train.py's flags for the equivalence runs on them."""
    root = tmp_path_factory.mktemp("own_text")
    model = tokenizer_folder(root / "model")  # the model folder's tokenizer.json first, then its weights
    tokenizer = Tokenizer.from_folder(model)
    config = dict(hf_models.tiny_config("mixtral"), vocab_size=tokenizer.vocab_size,
                  bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id)
    hf_models.make_folder(model, "mixtral", config=config)
    prepared = run("tools.prepare", "--tokenizer", model, "--out", root / "data",
                   write_documents(root / "texts", documents()), "--val", "4")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    argv = [*EQUIVALENCE, *STEPS, "--init-from", model, "--data", str(root / "data")]
    return dict(model=model, tokenizer=tokenizer, root=root, argv=argv)


@pytest.fixture(scope="module")
def trained(example):
    """{layout: (result, run folder)} of each layout's four steps, checkpoints at steps 2 and 4."""
    runs = example["root"] / "runs"
    return {name: (run_on_ranks(2, train_worker, [*example["argv"], *flags, "--out", str(runs), "--name", name],
                                timeout=300), runs / name)
            for name, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def single_device(example):
    return oracle(example["argv"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_trains_as_one_device(trained, single_device, layout):
    results, _ = trained[layout]
    for result in results:
        assert_matches_oracle(result, single_device)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_resumes_exactly_on_another_layout(example, trained, single_device, layout):
    saved = trained[layout][1] / "checkpoint-00000002"
    on = RESUMED_ON[layout]
    argv = [*example["argv"], *LAYOUTS[on], "--resume", str(saved),
            "--out", str(example["root"] / "resumed"), "--name", f"{layout}-on-{on}"]
    for result in run_on_ranks(2, train_worker, argv, timeout=300):
        assert len(result["losses"]) == 2  # steps 3 and 4 alone
        assert_matches_oracle(dict(result, losses=single_device["losses"][:2] + result["losses"]), single_device)


def sampled_text(capsys, *source):
    """What python -m tools.sample prints, greedy, from source (its --checkpoint or --init-from flags)."""
    sample.main([*map(str, source), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"])
    return capsys.readouterr().out


def test_every_checkpoint_and_the_export_print_model_py_greedy_decoding(example, trained, single_device,
                                                                        capsys, tmp_path):
    tokenizer = example["tokenizer"]
    config = cli.model_config(cli.parse_args(example["argv"]), tokenizer.vocab_size)
    ids = greedy(config, single_device["state_dict"], tokenizer.encode(PROMPT), NEW, tokenizer.eos_id)
    assert ids, "a continuation of no token checks nothing"
    expected = tokenizer.decode(ids) + "\n"
    for layout, (_, folder) in trained.items():
        assert sampled_text(capsys, "--checkpoint", folder) == expected, layout  # the run's newest: step 4
    newest = Checkpoint(str(trained["ep"][1] / "checkpoint-00000004"))
    assert TORCH_DTYPES[newest.tensors["tok_emb.weight"]["dtype"]] == torch.float64  # exported as it is
    exported = tmp_path / "exported"
    converted = run("tools.convert", "to-hf", trained["ep"][1], exported)  # the run's newest: step 4
    assert converted.returncode == 0, converted.stderr[-2000:]
    printed = run("tools.sample", "--init-from", exported, "--prompt", PROMPT, "--max-new-tokens", NEW,
                  "--temperature", 0)  # with the tokenizer.json the export carried along
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout == expected
