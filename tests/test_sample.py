"""python -m tools.sample: a prompt's continuation from a checkpoint of any layout or a Hugging Face folder.

A byte-level BPE tokenizer is trained (tests/texts.py: the tokenizers library's trainer, nothing downloaded), text
is prepared with it (python -m tools.prepare) and tiny models train on it for a step or two. What the command
prints is checked against model.py's greedy decoding written out in the test, on weights read independently
(python -m tools.convert's one-file export, read by the safetensors library).
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import hf_models
import train
from distributed import run_on_ranks
from model import GPT, GPTConfig
from texts import documents, greedy, run, tokenizer_folder, write_documents
from tools import convert, sample
from training import cli
from training.checkpoint import MANIFEST, Checkpoint, checkpoint_at
from training.tokenizer import Tokenizer

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

PROMPT = "the cat sat on"
NEW = 24  # more than the tiny models' 16 positions with the prompt: the context is cropped too
TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--lr", "1e-2", "--warmup", "1",
        "--log-interval", "1000", "--eval-interval", "1000"]


# -- what the tests sample from ---------------------------------------------------------------------------

def train_run(argv):
    """train.py on this rank (for run_on_ranks): its checkpoints are what the tests read."""
    train.train(cli.parse_args(argv))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{tokenizer, data, runs...}: a tokenizer, text prepared with it, and the runs trained on it."""
    root = tmp_path_factory.mktemp("sample")
    tokenizer = tokenizer_folder(root / "tokenizer")
    texts = write_documents(root / "texts", documents())
    prepared = run("tools.prepare", "--tokenizer", tokenizer, "--out", root / "data", texts)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    vocab = Tokenizer.from_folder(tokenizer).vocab_size
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(documents(10)))
    runs = root / "runs"
    for name, flags in [("prepared", ["--data", root / "data", "--steps", "2", "--checkpoint-interval", "1"]),
                        ("synthetic", ["--vocab-size", vocab, "--steps", "1"]),
                        ("bytes", ["--data", corpus, "--steps", "1"])]:
        run_on_ranks(1, train_run, [*TINY, *map(str, flags), "--out", str(runs), "--name", name], timeout=300)
    return dict(tokenizer=tokenizer, vocab=vocab, root=root, runs=runs,
                prepared=str(runs / "prepared" / "checkpoint-00000002"))


def weights(checkpoint, folder):
    """model.py's config and state dict of a checkpoint, through the one-file export and safetensors."""
    file = folder / "weights.safetensors"
    converted = run("tools.convert", "to-file", checkpoint, file, "--weights-only")
    assert converted.returncode == 0, converted.stderr[-2000:]
    with open(os.path.join(checkpoint, MANIFEST)) as f:
        config = GPTConfig(**json.load(f)["model"])
    state = load_file(file)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]  # saved once, as the embedding
    return config, state


def expected_text(made, checkpoint, tmp_path, tokenizer=None, prompt=PROMPT):
    tokenizer = tokenizer or Tokenizer.from_folder(made["tokenizer"])
    config, state = weights(checkpoint, tmp_path)
    ids = greedy(config, state, tokenizer.encode(prompt), NEW, tokenizer.eos_id)
    assert ids, "a continuation of no token checks nothing"
    return ids, tokenizer.decode(ids)


def sampled(*flags):
    return run("tools.sample", "--prompt", PROMPT, "--max-new-tokens", NEW, *flags)


def refused(capsys, *argv):
    """The message tools.sample exits with (status 1) for argv."""
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--prompt", PROMPT, *map(str, argv)])
    assert isinstance(exit_.value.code, str), capsys.readouterr().err
    return exit_.value.code


# -- model.py's generate: greedy at temperature 0, and EOS ----------------------------------------------------

def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, padded_vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16))


def test_generate_at_temperature_zero_is_the_argmax_cropped_to_max_seq_len():
    model, prompt = tiny_model(), torch.randint(0, 50, (2, 5))
    idx = prompt
    for _ in range(12):  # past the 8 positions the model has
        logits = model(idx[:, -8:])[0][:, -1, :50]
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, 12, temperature=0), idx)
    with pytest.raises(ValueError, match="temperature=-1 is negative"):
        model.generate(prompt, 1, temperature=-1)


def test_generate_stops_a_row_at_eos_and_pads_it_until_every_row_is_done():
    model, prompt = tiny_model(), torch.randint(0, 50, (2, 5))
    free = model.generate(prompt, 10, temperature=0)[:, 5:].tolist()
    eos = free[0][2]  # row 0 emits it third
    rows = [row[:row.index(eos) + 1] if eos in row else row for row in free]  # each up to its first EOS
    length = max(map(len, rows))
    out = model.generate(prompt, 10, temperature=0, eos_id=eos)[:, 5:]
    assert out.tolist() == [row + [eos] * (length - len(row)) for row in rows]
    alone = model.generate(prompt[:1], 10, temperature=0, eos_id=eos)
    assert alone[0, 5:].tolist() == free[0][:3]  # one row: stops right after its EOS


# -- the command ----------------------------------------------------------------------------------------------

def test_sample_greedy_prints_model_greedy_decoding_token_for_token(made, tmp_path):
    ids, text = expected_text(made, made["prepared"], tmp_path)
    out = sampled("--checkpoint", made["prepared"], "--temperature", 0)  # the tokenizer: the data's meta.json
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == text + "\n"
    assert "the model attends to 16 tokens" in out.stderr  # the prompt and NEW tokens are more
    _, tokenizer, load = sample.from_checkpoint(made["prepared"], None)
    assert tokenizer.source == made["tokenizer"]
    model = load(None, torch.device("cpu"))
    assert sample.continuations(model, tokenizer.encode(PROMPT), tokenizer.eos_id, 1, NEW, temperature=0) == [ids]
    wider = load(torch.float64, torch.device("cpu"))  # --dtype: the saved values, in another dtype
    assert torch.equal(wider.blocks[1].mlp.fc.weight, model.blocks[1].mlp.fc.weight.double())


def test_seeded_sampling_prints_the_same_text_twice(made):
    flags = ["--checkpoint", made["prepared"], "--temperature", "1.5", "--top-k", "40", "--samples", "2"]
    first, second = sampled(*flags, "--seed", 3), sampled(*flags, "--seed", 3)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout == second.stdout and first.stdout.count("\n---\n") == 1
    _, tokenizer, load = sample.from_checkpoint(made["prepared"], None)
    model, ids = load(None, torch.device("cpu")), tokenizer.encode(PROMPT)
    draws = {seed: sample.continuations(model, ids, tokenizer.eos_id, 2, NEW, 1.5, 40, seed) for seed in (3, 4)}
    assert "\n---\n".join(tokenizer.decode(ids) for ids in draws[3]) + "\n" == first.stdout
    assert draws[3] != draws[4] and draws[3][0] != draws[3][1]  # the seed and the row change the draws


def test_a_run_folder_samples_its_newest_good_checkpoint(made, tmp_path, capsys):
    run_dir = made["runs"] / "prepared"
    _, text = expected_text(made, made["prepared"], tmp_path)
    out = sampled("--checkpoint", run_dir, "--temperature", 0)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == text + "\n" and "checkpoint-00000002 (step 2)" in out.stderr
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    os.remove(copy / "checkpoint-00000002" / MANIFEST)  # a save that never finished
    assert checkpoint_at(str(copy), report=sample.note) == str(copy / "checkpoint-00000001")
    assert "checkpoint-00000002: incomplete" in capsys.readouterr().err
    os.remove(copy / "checkpoint-00000001" / MANIFEST)
    assert "none of its checkpoints is complete" in refused(capsys, "--checkpoint", copy)
    assert "checkpoint-00000002: incomplete" in refused(capsys, "--checkpoint", copy / "checkpoint-00000002")
    assert "neither a checkpoint" in refused(capsys, "--checkpoint", made["root"] / "texts")
    assert "no such folder" in refused(capsys, "--checkpoint", tmp_path / "nowhere")


def test_tokenizer_is_required_when_nothing_records_one(made, tmp_path, capsys):
    synthetic = str(made["runs"] / "synthetic" / "checkpoint-00000001")
    message = refused(capsys, "--checkpoint", synthetic)
    assert "synthetic language" in message and "pass --tokenizer FOLDER" in message
    _, text = expected_text(made, synthetic, tmp_path)
    sample.main(["--checkpoint", synthetic, "--tokenizer", made["tokenizer"], "--prompt", PROMPT,
                 "--max-new-tokens", str(NEW), "--temperature", "0"])
    assert capsys.readouterr().out == text + "\n"


def test_clear_errors(made, tmp_path, capsys):
    synthetic = made["runs"] / "synthetic" / "checkpoint-00000001"
    message = refused(capsys, "--checkpoint", synthetic, "--tokenizer", made["tokenizer"], "--prompt", "")
    assert "has no tokens" in message  # GPT-2's layout adds no BOS: an empty prompt is nothing to continue
    bigger = tokenizer_folder(tmp_path / "bigger", vocab_size=400)
    message = refused(capsys, "--checkpoint", synthetic, "--tokenizer", bigger)
    assert f"the tokenizer has {Tokenizer.from_folder(bigger).vocab_size} ids" in message
    assert f"vocabulary {made['vocab']}" in message
    message = refused(capsys, "--checkpoint", made["prepared"], "--tokenizer", bigger)
    assert "is not the one that prepared the run's --data" in message
    moved = made["root"] / "moved"  # the data, its tokenizer's folder gone
    shutil.copytree(made["root"] / "data", moved)
    meta = json.loads((moved / "meta.json").read_text())
    del meta["sha256"]  # (edited by hand: its own digest goes, or the folder is refused as damaged)
    (moved / "meta.json").write_text(json.dumps(dict(meta, tokenizer=str(tmp_path / "gone"))))
    nanogpt = tmp_path / "nanogpt"  # ids without a record of what made them
    nanogpt.mkdir()
    for run_args, why in [(dict(data=str(moved)), f"the tokenizer that prepared its --data {moved}, "),
                          (dict(data=str(nanogpt)), "which records no tokenizer"),
                          (dict(init_from=str(nanogpt)), "which holds no tokenizer.json")]:
        with pytest.raises(sample.SampleError, match="pass --tokenizer FOLDER") as error:
            sample.tokenizer_of_run(run_args, made["vocab"], None)
        assert why in str(error.value)
    for flags, wrong in [(["--max-new-tokens", "-1"], "--max-new-tokens -1"), (["--top-k", "0"], "--top-k 0"),
                         (["--temperature", "-0.5"], "--temperature -0.5"), (["--samples", "0"], "--samples 0")]:
        with pytest.raises(SystemExit) as exit_:
            sample.main(["--checkpoint", str(synthetic), "--prompt", PROMPT, *flags])
        assert exit_.value.code == 2 and f"{wrong}: must be at least" in capsys.readouterr().err


def test_a_run_on_a_text_file_reads_and_writes_bytes(made, tmp_path, capsys):
    checkpoint = str(made["runs"] / "bytes" / "checkpoint-00000001")
    config, state = weights(checkpoint, tmp_path)
    ids = greedy(config, state, list(PROMPT.encode()), NEW, eos_id=None)
    sample.main(["--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"])
    assert capsys.readouterr().out == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_a_hugging_face_export_samples_the_same(made, tmp_path, capsys):
    _, text = expected_text(made, made["prepared"], tmp_path)
    folder = tmp_path / "exported"
    convert.export_hf(made["prepared"], str(folder))  # carries the run's tokenizer files along
    out = sampled("--init-from", folder, "--tokenizer", made["tokenizer"], "--temperature", 0)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == text + "\n"
    sample.main(["--init-from", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"])
    assert capsys.readouterr().out == text + "\n"  # its own tokenizer.json, the same
    os.remove(folder / "tokenizer.json")
    assert "holds no tokenizer.json: pass --tokenizer" in refused(capsys, "--init-from", folder)


def test_a_pipeline_checkpoint_of_a_tied_model_from_a_hugging_face_folder(made, tmp_path, capsys):
    """Two pipeline stages, the output layer tied to the embedding (GPT-2's), the tokenizer the one of the
    --init-from folder the run started from."""
    start = tmp_path / "gpt2"
    hf_models.make_folder(str(start), "gpt2", dtype=torch.float32,
                          config=dict(hf_models.tiny_config("gpt2"), vocab_size=made["vocab"]))
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(made["tokenizer"], name), start / name)
    run_on_ranks(2, train_run, [*TINY, "--init-from", str(start), "--pp", "2", "--micro-batches", "2", "--steps",
                                "1", "--out", str(tmp_path / "runs"), "--name", "pp"], timeout=300)
    checkpoint = str(tmp_path / "runs" / "pp" / "checkpoint-00000001")
    assert "lm_head.weight" not in Checkpoint(checkpoint).tensors  # saved once, as the embedding
    _, text = expected_text(made, checkpoint, tmp_path)
    sample.main(["--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"])
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_qwen3_folder_samples_what_its_own_forward_predicts(made, tmp_path, capsys, arch):
    """A Qwen3 folder (heads wider than width/heads, QK-norm, tied embeddings; the MoE's dense first layer and
    experts of their own width) continues the prompt as tests/hf_models.py's functional forward, written from
    Hugging Face's semantics and not from model.py, predicts greedily, token for token."""
    folder = tmp_path / arch
    hf_models.make_folder(str(folder), arch, config=dict(hf_models.tiny_config(arch), vocab_size=made["vocab"]))
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(made["tokenizer"], name), folder / name)
    tokenizer = Tokenizer.from_folder(made["tokenizer"])
    ids, new = tokenizer.encode(PROMPT), []
    for _ in range(NEW):  # prompt and continuation within the folder's 64 positions: nothing cropped
        token = hf_models.reference_logits(str(folder), [ids + new])[0, -1].argmax().item()
        if token == tokenizer.eos_id:
            break
        new.append(token)
    assert new, "a continuation of no token checks nothing"
    sample.main(["--init-from", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"])
    assert capsys.readouterr().out == tokenizer.decode(new) + "\n"
