"""Hugging Face model folders in and out (training/hf.py), for every architecture it reads.

- model.py, loaded from a folder, gives the logits of an independent forward written from transformers'
  semantics (tests/hf_models.py), in float64;
- train.py --init-from trains the same under every layout as one device started from the folder (which
  puts the new config fields through the dimensions they touch: a tied output layer through tp's
  vocabulary split, across pipeline stages and on rank 0 alone in ZB-V's V, the tanh GELU and the padded
  vocabulary through tp, each norm's epsilon under sp, rotary scaling and q/k/v biases through tp and cp,
  Mixtral's experts under ep; Qwen3's QK-norm and heads wider than hidden / heads through tp with and without
  sp, cp and pipelines, Qwen3-MoE's dense and sparse layers and renormalised gates under ep folded over tp and
  ZeRO-3, Qwen2-MoE's gated shared expert and unnormalised gates under expert-tp and cp's all-to-all);
- a folder saved by transformers 4 (rope_theta, rope_scaling) or by 5 (rope_parameters) loads as the same model,
  rotary settings stated twice differently or of a kind model.py lacks are refused by name, and the config
  training/hf.py exports reads back as the model it was made of;
- training/hf.py export writes any layout's checkpoint back as the folder it came from, bit for bit.
"""
import dataclasses
import json
import re
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


def model_logits(folder, seq_len=12):
    """model.py's logits (float64) of a folder as hf.py reads it, and the independent reference's, for one batch."""
    config = hf.config_from_hf(hf.read_config(folder), seq_len=seq_len)
    model = GPT(config).double()
    model.load_state_dict(hf.load_state_dict(folder, config))
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))
    return model(ids)[0][..., :config.vocab_size], hf_models.reference_logits(folder, ids)


# The rotary settings as each transformers writes them, for a Llama 3.1-style model (theta 500,000, llama3
# scaling) and a Mixtral (theta 1e6): transformers 4 at the top level (configuration_llama.py's rope_theta and
# rope_scaling; configuration_mixtral.py's rope_theta alone), transformers 5 in one dict, rope_parameters,
# with rope_theta and rope_type in it and nothing at the top level (modeling_rope_utils.py's
# RotaryEmbeddingConfigMixin: convert_rope_params_to_dict, standardize_rope_params).
LLAMA3 = dict(factor=8.0, low_freq_factor=0.0625, high_freq_factor=0.125, original_max_position_embeddings=16)
WRITTEN = {"llama3.1": ({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
                        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}),
           "mixtral": ({"rope_theta": 1000000.0}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})}
ROTARY = dict(rope_theta=None, rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_context=8192)  # GPTConfig's rotary fields (their defaults: no scaling)
EXPECTED = {"llama3.1": dict(ROTARY, rope_theta=500000.0, rope_factor=8.0, rope_low_freq_factor=0.0625,
                             rope_high_freq_factor=0.125, rope_original_context=16),
            "mixtral": dict(ROTARY, rope_theta=1e6)}


def rotary_of(config):
    return {name: getattr(config, name) for name in ROTARY}


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_folders_saved_by_transformers_4_and_5_load_as_the_same_model(tmp_path, arch):
    """The same model saved by transformers 4 and by 5 (and with both forms, agreeing) loads to one GPTConfig,
    whose logits are the reference's reading each file as transformers does."""
    v4, v5 = hf_models.tiny_config(arch), hf_models.tiny_config(arch, transformers=5)
    if arch in WRITTEN:
        for written, rope in zip((v4, v5), WRITTEN[arch]):
            assert {k: written[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in written} == rope
    configs = []
    for name, written in [("v4", v4), ("v5", v5), ("both", v4 | v5)]:
        hf_models.make_folder(str(tmp_path / name), arch, config=written)
        configs.append(hf.config_from_hf(hf.read_config(str(tmp_path / name)), seq_len=12))
        torch.testing.assert_close(*model_logits(str(tmp_path / name)), rtol=1e-12, atol=1e-14)
    assert configs[0] == configs[1] == configs[2]
    if arch in EXPECTED:
        assert rotary_of(configs[1]) == EXPECTED[arch]


@pytest.mark.parametrize("arch,theta", [("llama", 10000.0), ("mistral", 10000.0), ("qwen2", 10000.0),
                                        ("mixtral", 1e6)])
def test_a_folder_stating_no_rope_theta_rotates_by_its_config_class_default(tmp_path, arch, theta):
    """transformers' default, the same in 4 and 5: MixtralConfig's 1e6, the others' 10000."""
    v4 = {k: v for k, v in hf_models.tiny_config(arch).items() if k != "rope_theta"}
    v5 = hf_models.tiny_config(arch, transformers=5)
    del v5["rope_parameters"]["rope_theta"]
    for name, written in [("v4", v4), ("v5", v5)]:
        assert hf.config_from_hf(written, seq_len=12).rope_theta == theta
        hf_models.make_folder(str(tmp_path / name), arch, config=written)
        torch.testing.assert_close(*model_logits(str(tmp_path / name)), rtol=1e-12, atol=1e-14)


def test_rotary_settings_stated_twice_differently_or_unsupported_are_refused_by_name():
    v4, v5 = hf_models.tiny_config("llama3.1"), hf_models.tiny_config("llama3.1", transformers=5)
    mixtral4, mixtral5 = hf_models.tiny_config("mixtral"), hf_models.tiny_config("mixtral", transformers=5)
    rope5 = v5["rope_parameters"]
    cases = [  # (config.json, a pattern the refusal must name)
        # both forms, disagreeing: transformers 4 would read the first, 5 the other
        (v4 | {"rope_parameters": dict(rope5, rope_theta=10000.0)}, r"rope_theta=500000.0.*rope_parameters"),
        (v5 | {"rope_theta": 10000.0}, r"rope_theta=10000.0.*rope_parameters\['rope_theta'\]=500000.0"),
        (mixtral4 | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_parameters"),
        (v4 | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, r"rope_scaling=.*rope_parameters="),
        (v5 | {"rope_scaling": None}, r"rope_scaling=None.*rope_parameters="),  # 4 says no scaling, 5 says llama3
        (v5 | {"rope_scaling": dict(rope5, factor=4.0)}, r"rope_scaling=.*rope_parameters="),
        # rope types model.py cannot represent, under either name
        (v5 | {"rope_parameters": dict(rope5, rope_type="yarn")}, "rope_parameters.*'yarn'"),
        (mixtral5 | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
         "rope_parameters.*'dynamic'"),
        (v4 | {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.*'linear'"),
        (v4 | {"rope_scaling": dict(v4["rope_scaling"], type="linear")}, "rope_scaling.*rope_type and type"),
        # settings of the rotary form model.py has no field for
        (v5 | {"rope_parameters": {"full_attention": rope5, "sliding_attention": rope5}}, "rope_parameters"),
        (v5 | {"rope_parameters": {"full_attention": None}}, "rope_parameters.*per attention kind"),
        (v5 | {"rope_parameters": dict(rope5, partial_rotary_factor=0.5)}, "rope_parameters"),
        (v5 | {"rope_parameters": {k: v for k, v in rope5.items() if k != "low_freq_factor"}},
         "rope_parameters.*without low_freq_factor"),
    ]
    for config, pattern in cases:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.config_from_hf(config, seq_len=12)


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_the_exported_config_reads_back_as_the_same_model(tmp_path, arch):
    """hf_from_config writes transformers 4's form (which transformers 5 reads as well): it reads back to the
    GPTConfig it was made of, and the reference, reading it as transformers does, computes model.py's logits."""
    config = hf.config_from_hf(hf_models.tiny_config(arch, transformers=5), seq_len=12)
    exported = hf.hf_from_config(config)
    assert "rope_parameters" not in exported
    assert hf.config_from_hf(exported, seq_len=12) == config
    hf_models.make_folder(str(tmp_path), arch, config=json.loads(json.dumps(exported)))  # as config.json holds it
    torch.testing.assert_close(*model_logits(str(tmp_path)), rtol=1e-12, atol=1e-14)


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
    ("qwen3", 4, ["--tp", "2", "--sp", "--cp", "2"]),   # QK-norm's weights summed over tp under sp; heads of 16 on 32
    ("qwen3", 4, ["--tp", "2", "--pp", "2"]),           # ... and without sp; tied across stages
    ("qwen3_moe", 4, ["--tp", "2", "--ep", "2", "--cp", "2", "--cp-mode", "allgather"]),  # ep folded over tp
    ("qwen3_moe", 2, ["--zero", "3", "--ep", "2"]),      # a dense first layer beside the sparse ones, sharded
    ("qwen2_moe", 4, ["--tp", "2", "--sp", "--ep", "2", "--expert-tp", "2"]),  # the shared expert and its gate
    ("qwen2_moe", 4, ["--pp", "2", "--cp", "2", "--cp-mode", "alltoall"]),     # sparse every second layer
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
           ("llama", 2, ["--pp", "2", "--zero", "1"]), ("qwen3", 2, ["--tp", "2"]),
           ("qwen3_moe", 2, ["--tp", "2", "--ep", "2"]), ("qwen2_moe", 2, ["--tp", "2", "--expert-tp", "2"])]


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
                                 ("llama", "hidden_act", "gelu"),
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


def test_qwen_settings_model_py_cannot_represent_are_refused_by_name():
    """Qwen3's biases on q, k, v and o but none in its MLP, a sliding window on some layers, Qwen3's long-context
    YaRN scaling (its model card's rope_scaling), and an exported model no family here computes."""
    qwen3, qwen2_moe = hf_models.tiny_config("qwen3"), hf_models.tiny_config("qwen2_moe", transformers=5)
    for config, pattern in [
            (qwen3 | {"attention_bias": True}, "attention_bias"),
            (qwen2_moe | {"use_sliding_window": True, "sliding_window": 8}, "sliding_window"),
            (qwen3 | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
             "rope_scaling.*'yarn'")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.config_from_hf(config, seq_len=16)
    mixtral_like = hf.config_from_hf(hf_models.tiny_config("qwen3_moe"), seq_len=12)
    with pytest.raises(hf.UnsupportedModel, match="shared expert"):
        hf.hf_from_config(dataclasses.replace(mixtral_like, qk_norm=False, n_shared_experts=1))


def test_the_qwen_moe_layers_are_those_transformers_makes_sparse():
    """mlp_only_layers and decoder_sparse_step (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer): Qwen3-MoE's first
    layer dense, Qwen2-MoE's every second; their experts' own width, and the gates renormalised or not."""
    qwen3_moe = hf.config_from_hf(hf_models.tiny_config("qwen3_moe", transformers=5), seq_len=12)
    qwen2_moe = hf.config_from_hf(hf_models.tiny_config("qwen2_moe"), seq_len=12)
    assert (qwen3_moe.moe_layers, qwen3_moe.norm_topk_prob, qwen3_moe.d_expert, qwen3_moe.d_ff) \
        == ((1, 2, 3), True, 24, 96)
    assert (qwen2_moe.moe_layers, qwen2_moe.norm_topk_prob, qwen2_moe.d_shared, qwen2_moe.shared_expert_gate) \
        == ((1, 3), False, 48, True)
    assert qwen3_moe.qk_norm and qwen3_moe.head_dim == 16 and not qwen2_moe.qk_norm


def test_zero3_with_a_tied_output_layer_is_refused(folders):
    """ZeRO-3 gathers the embedding and the output layer as two units: a weight both hold is refused, not
    gathered twice."""
    with pytest.raises(cli.ConfigError, match="tied output layer"):
        cli.check_args(cli.parse_args([*ARGS, "--init-from", folders["gpt2"], "--zero", "3"]), 2)
    cli.check_args(cli.parse_args([*ARGS, "--init-from", folders["llama"], "--zero", "3"]), 2)  # untied: fine


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layers_keeps_the_first_blocks_of_a_folder_and_exports_as_such(tmp_path, folders, arch):
    """--layers 2 with --init-from: the model is the folder's first two blocks (a smaller model to check a
    layout with), its export says two layers and holds those blocks' tensors bit for bit; more blocks than
    the folder has are refused."""
    argv = [*ARGS, "--steps", "1", "--lr", "0", "--init-from", folders[arch], "--layers", "2", "--tp", "2",
            "--out", str(tmp_path)]
    run_on_ranks(2, train_worker, argv, timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path, os.listdir(tmp_path)[0]))[0]
    out = str(tmp_path / "exported")
    convert.export_hf(saved, out)
    layers_key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    assert hf.read_config(out) == hf.read_config(folders[arch]) | {layers_key: 2, "torch_dtype": "float64"}
    original = tensors_of(folders[arch])
    kept = {name: t for name, t in original.items() if not re.search(r"\.(h|layers)\.[23]\.", name)}
    assert tensors_of(out).keys() == kept.keys() and len(kept) < len(original)
    for name, expected in kept.items():
        assert torch.equal(tensors_of(out)[name], expected), name
    with pytest.raises(cli.ConfigError, match="--layers 5: --init-from .* has 4 blocks"):
        cli.check_args(cli.parse_args([*ARGS, "--init-from", folders[arch], "--layers", "5"]), 1)
