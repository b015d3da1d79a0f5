"""Hugging Face model folders in and out (training/hf.py), for every architecture it reads.

- model.py, loaded from a folder, gives the logits of an independent forward written from transformers'
  semantics (tests/hf_models.py), in float64;
- train.py --init-from trains the same under every layout as one device started from the folder (which
  puts the new config fields through the dimensions they touch: a tied output layer through tp's
  vocabulary split, across pipeline stages and on rank 0 alone in ZB-V's V, the tanh GELU and the padded
  vocabulary through tp, each norm's epsilon under sp, rotary scaling and q/k/v biases through tp and cp,
  Mixtral's experts under ep);
- training/hf.py export writes any layout's checkpoint back as the folder it came from, bit for bit.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from training import checkpoint
from training import cli
from training import hf
from tools import convert
import hf_models
from distributed import run_on_ranks
from model import GPT
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan

ARGS = [*EQUIVALENCE, "--seq-len", "16", "--steps", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{architecture: a tiny model folder}, float64; Mixtral's and Qwen2's in three files with an index."""
    root = tmp_path_factory.mktemp("hf")
    for arch in hf_models.ARCHITECTURES:
        hf_models.make_folder(str(root / arch), arch, shards=3 if arch in ("mixtral", "qwen2") else 1)
    return {arch: str(root / arch) for arch in hf_models.ARCHITECTURES}


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_model_py_gives_the_reference_logits(folders, arch):
    config = hf.config_from_hf(hf.read_config(folders[arch]), seq_len=12)
    model = GPT(config).double()
    model.load_state_dict(hf.load_state_dict(folders[arch], config))
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(ids)[0]
    expected = hf_models.reference_logits(folders[arch], ids)
    torch.testing.assert_close(logits[..., :config.vocab_size], expected, rtol=1e-12, atol=1e-14)


# (architecture, ranks, layout): each new config field through the dimensions it touches.
LAYOUTS = [
    ("gpt2", 2, ["--tp", "2"]),                        # tied, vocabulary 61 padded to 64, tanh GELU, split by tp
    ("gpt2", 4, ["--pp", "2", "--zero", "1"]),         # the tied weight's two copies, ZeRO-1 over 2 data ranks
    ("gpt2", 4, ["--pp", "2", "--schedule", "zbv", "--zero", "1", "--micro-batches", "4"]),  # in a V: one copy
    ("gpt2", 4, ["--tp", "2", "--sp", "--cp", "2"]),   # LayerNorm's epsilon under sp, learned positions under cp
    ("llama3.2", 4, ["--tp", "2", "--pp", "2"]),        # tied and split, across stages; rotary scaling
    ("llama3.1", 4, ["--cp", "2", "--tp", "2", "--sp"]),  # rotary scaling at cp's zigzag positions; RMSNorm 1e-5
    ("llama", 2, ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "4"]),
    ("mistral", 2, ["--zero", "3"]),
    ("qwen2", 4, ["--tp", "2", "--sp", "--cp", "2"]),   # q/k/v biases split by heads; RMSNorm 1e-6 under sp
    ("qwen2", 4, ["--pp", "2", "--tp", "2"]),            # tied across stages and split by tp
    ("mixtral", 4, ["--ep", "2", "--tp", "2"]),          # experts over ep, each split by tp
    ("mixtral", 4, ["--ep", "2", "--pp", "2", "--zero", "1"]),
]


@pytest.mark.parametrize("arch,world,flags", LAYOUTS,
                         ids=[f"{arch}-{'-'.join(f.lstrip('-') for f in flags)}" for arch, _, flags in LAYOUTS])
def test_layouts_train_as_one_device_from_the_folder(tmp_path, folders, arch, world, flags):
    argv = [*ARGS, "--init-from", folders[arch]]
    results = run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=300)
    for result in results:
        assert_matches_oracle(result, oracle(argv))
    assert_matches_plan(tmp_path, [*argv, *flags], world)


EXPORTS = [("gpt2", 2, ["--pp", "2"]), ("llama3.2", 2, ["--tp", "2"]), ("llama3.1", 1, []),
           ("mistral", 2, ["--zero", "3"]), ("qwen2", 2, ["--tp", "2"]), ("mixtral", 2, ["--ep", "2"]),
           ("llama", 2, ["--pp", "2", "--zero", "1"])]


@pytest.mark.parametrize("arch,world,flags", EXPORTS,
                         ids=[f"{arch}-{'-'.join(f.lstrip('-') for f in flags) or 'one'}" for arch, _, flags in EXPORTS])
def test_a_loaded_checkpoint_exports_bit_identically(tmp_path, folders, arch, world, flags):
    """Loaded under a layout, saved (one step at lr 0: no weight moves), exported: every tensor of the folder
    is written back bit for bit, under its name, and config.json with it."""
    argv = [*ARGS, "--steps", "1", "--lr", "0", "--init-from", folders[arch], *flags, "--out", str(tmp_path)]
    run_on_ranks(world, train_worker, argv, timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path, os.listdir(tmp_path)[0]))[0]
    out = str(tmp_path / "exported")
    convert.export_hf(saved, out, max_shard_bytes=20_000)  # several files, with their index
    assert sorted(os.listdir(out)).count("model.safetensors.index.json") == 1
    assert tensors_of(out).keys() == tensors_of(folders[arch]).keys()
    for name, expected in tensors_of(folders[arch]).items():
        assert torch.equal(tensors_of(out)[name], expected), name
    original, exported = hf.read_config(folders[arch]), hf.read_config(out)
    assert exported == original | dict(torch_dtype="float64")


def tensors_of(folder):
    """Every tensor of a Hugging Face folder, read by the safetensors library (as transformers reads them)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    files = {"model.safetensors"}
    if os.path.exists(index):
        with open(index) as f:
            files = set(json.load(f)["weight_map"].values())
    return {name: t for file in files for name, t in load_file(os.path.join(folder, file)).items()}


def test_settings_model_py_cannot_represent_are_refused_by_name(tmp_path):
    for arch, setting, value in [("gpt2", "activation_function", "relu"),
                                 ("gpt2", "scale_attn_by_inverse_layer_idx", True),
                                 ("llama", "hidden_act", "gelu"), ("llama", "head_dim", 16),
                                 ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                 ("llama", "mlp_bias", True), ("mistral", "sliding_window", 8)]:
        config = hf_models.tiny_config(arch) | {setting: value}
        hf_models.make_folder(str(tmp_path / arch), arch, config=config)
        args = cli.parse_args([*ARGS, "--init-from", str(tmp_path / arch)])
        with pytest.raises(cli.ConfigError, match=setting):
            cli.check_args(args, 1)


@pytest.mark.parametrize("model", [["--arch", "gpt"], ["--arch", "llama"], ["--arch", "llama", "--experts", "4"]],
                         ids=["gpt2", "llama", "mixtral"])
def test_a_run_from_scratch_exports_as_the_matching_architecture(tmp_path, model):
    """A run that did not start from a folder is written as GPT-2, Llama or Mixtral (its config made here), and
    the independent reference computes from that folder the logits model.py computes from the checkpoint."""
    argv = [*ARGS, "--steps", "1", "--out", str(tmp_path), *model]
    run_on_ranks(2, train_worker, [*argv, "--tp", "2"], timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path, os.listdir(tmp_path)[0]))[0]
    convert.export_hf(saved, str(tmp_path / "exported"))
    config = cli.model_config(cli.parse_args(argv), 64)
    trained = GPT(config).double()
    trained.load_state_dict(checkpoint.Checkpoint(saved).model_state())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(trained(ids)[0], hf_models.reference_logits(str(tmp_path / "exported"), ids),
                               rtol=1e-12, atol=1e-14)


def test_zero3_with_a_tied_output_layer_is_refused(folders):
    """ZeRO-3 gathers the embedding and the output layer as two units: a weight both hold is refused, not
    gathered twice."""
    with pytest.raises(cli.ConfigError, match="tied output layer"):
        cli.check_args(cli.parse_args([*ARGS, "--init-from", folders["gpt2"], "--zero", "3"]), 2)
    cli.check_args(cli.parse_args([*ARGS, "--init-from", folders["llama"], "--zero", "3"]), 2)  # untied: fine
