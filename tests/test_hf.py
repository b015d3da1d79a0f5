"""Hugging Face model folders in and out (training/hf.py), for every architecture it reads.

- model.py, loaded from a folder, gives the logits of an independent forward written from transformers'
  semantics (tests/hf_models.py), in float64;
- train.py --init-from trains the same under every layout as one device started from the folder (which
  puts the new config fields through the dimensions they touch: a tied output layer through tp's
  vocabulary split, across pipeline stages and on rank 0 alone in ZB-V's V, the tanh GELU and the padded
  vocabulary through tp, each norm's epsilon under sp, rotary scaling and q/k/v biases through tp and cp,
  Mixtral's experts under ep; Qwen3's QK-norm and heads wider than hidden / heads through tp with and without
  sp, cp and pipelines, Qwen3-MoE's dense and sparse layers and renormalised gates under ep folded over tp and
  ZeRO-3, Qwen2-MoE's gated shared expert and unnormalised gates under expert-tp and cp's all-to-all;
  DeepSeek-V3's latent attention, YaRN, interleaved rotation and grouped sigmoid router with its correction
  bias under tp with sp, cp, pp with ep, and tp, pp, ep and ZeRO-3 at once);
- a folder saved by transformers 4 (rope_theta, rope_scaling) or by 5 (rope_parameters) loads as the same model,
  rotary settings stated twice differently or of a kind model.py lacks are refused by name, and the config
  training/hf.py exports reads back as the model it was made of;
- training/hf.py export writes any layout's checkpoint back as the folder it came from, bit for bit (less
  DeepSeek-V3's multi-token-prediction layers, which are read past and not written: see hf.with_layers; of Gemma 3's
  multimodal folder its language model, as Gemma 3's text folder);
- Gemma 3's and OLMo's settings model.py cannot represent, or that transformers 4 and 5 read apart, are refused by
  name, as are exported models their modeling code does not compute.
"""
import dataclasses
import json
import re
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from training import checkpoint
from training import cli
from training import hf
from tools import convert, sample
import hf_models
from distributed import run_on_ranks
from model import GPT, KVCache
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker
from planned import assert_matches_plan

ARGS = [*EQUIVALENCE, "--seq-len", "16", "--steps", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{architecture: a tiny model folder}, float64; Mixtral's, Qwen2's and DeepSeek-V3's (its multi-token-
    prediction layer in the last file) in three files with an index."""
    root = tmp_path_factory.mktemp("hf")
    for arch in hf_models.ARCHITECTURES:
        hf_models.make_folder(str(root / arch), arch, shards=3 if arch in ("mixtral", "qwen2", "deepseek_v3") else 1)
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



def test_a_qwen3_moe_folder_counting_num_local_experts_is_the_model_counting_num_experts(tmp_path):
    """transformers 5.24 writes a Qwen3-MoE config's expert count as num_local_experts, with no num_experts:
    such a folder (and one with both, agreeing) loads as the same GPTConfig and the same weights as the one
    saying num_experts, so it trains as that one does, and exports as it (num_experts); two counts that
    differ are refused by name."""
    v5 = hf_models.tiny_config("qwen3_moe", transformers=5)
    v5_24 = hf_models.as_transformers_5_24(v5)
    assert "num_experts" not in v5_24
    configs, weights = [], []
    for name, written in [("num_experts", v5), ("num_local_experts", v5_24), ("both", v5 | v5_24)]:
        folder = str(tmp_path / name)
        hf_models.make_folder(folder, "qwen3_moe", config=written)
        configs.append(hf.config_from_hf(hf.read_config(folder), seq_len=12))
        weights.append(hf.load_state_dict(folder, configs[-1]))
        torch.testing.assert_close(*model_logits(folder), rtol=1e-12, atol=1e-14)
    assert configs[0] == configs[1] == configs[2] and configs[0].n_experts == v5["num_experts"]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys() and all(torch.equal(other[k], weights[0][k]) for k in other)
    assert hf.hf_from_config(configs[1]) == hf.hf_from_config(configs[0])
    assert hf.hf_from_config(configs[1])["num_experts"] == v5["num_experts"]
    with pytest.raises(hf.UnsupportedModel, match="num_local_experts=8: it also says num_experts=4: two expert counts"):
        hf.config_from_hf(v5 | {"num_local_experts": 8}, seq_len=12)

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
    ("gpt2", 4, ["--pp", "2", "--zero", "3"]),         # the tied weight's two copies, each ZeRO-3's on its stage
    ("gpt2", 4, ["--pp", "2", "--schedule", "zbv", "--zero", "3", "--micro-batches", "4"]),  # one copy, lent
    ("llama3.2", 4, ["--tp", "2", "--pp", "2"]),        # tied and split, across stages; rotary scaling
    ("llama3.1", 4, ["--cp", "2", "--tp", "2", "--sp"]),  # rotary scaling at cp's zigzag positions; RMSNorm 1e-5
    ("llama", 2, ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "4"]),
    ("mistral", 2, ["--zero", "3"]),
    ("mistral_window", 4, ["--tp", "2", "--cp", "2", "--cp-mode", "allgather"]),  # a window of 6 in 16 tokens
    ("qwen2_window", 2, ["--pp", "2"]),                 # ... on the last two layers, the second stage's
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
    # latent attention split by heads (its permuted rotated rows and replicated down-projections), YaRN; the
    # routing bias read from the folder choosing experts in every layout
    ("deepseek_v3", 2, ["--tp", "2", "--sp"]),
    ("deepseek_v3_q_proj", 2, ["--cp", "2"]),  # q_proj, half-split rotation and YaRN's gains at cp's positions
    ("deepseek_v3", 4, ["--pp", "2", "--ep", "2"]),  # the dense first layer on one stage, grouped routing over ep
    ("deepseek_v3", 8, ["--tp", "2", "--pp", "2", "--ep", "2", "--zero", "3"]),
    # gpt-oss: sinks split with their heads, windows on every second layer, biases, interleaved experts (MXFP4
    # dequantized by each rank for the experts it holds) and YaRN without truncation
    ("gpt_oss_mxfp4", 4, ["--tp", "2", "--sp", "--cp", "2", "--cp-mode", "ring"]),
    ("gpt_oss", 4, ["--tp", "2", "--ep", "2", "--cp", "2", "--cp-mode", "allgather"]),  # ep folded over tp
    ("gpt_oss_mxfp4", 2, ["--cp", "2", "--cp-mode", "alltoall"]),  # (expert tp: test_parity's round trip)
    ("gpt_oss", 4, ["--pp", "2", "--schedule", "zbv", "--zero", "3"]),
    # Gemma 3 (tied, four norms a block, per-kind rotary bases, linear scaling, windows) and OLMo 2 and 3 (norms
    # after the sub-layers, QK-norm over each whole projection): every dimension from their folders
    ("gemma3_text", 2, ["--tp", "2", "--sp"]),
    ("gemma3", 2, ["--cp", "2", "--cp-mode", "ring"]),  # the multimodal folder's language model
    ("gemma3_text", 2, ["--cp", "2", "--cp-mode", "alltoall"]),
    ("gemma3_text", 2, ["--pp", "2", "--schedule", "zbv"]),  # the tied embedding on both ends of the V
    ("gemma3_text", 4, ["--zero", "3", "--dp-shard", "2", "--tp", "2"]),  # hybrid sharding of the tied weight
    ("olmo2", 2, ["--tp", "2", "--recompute", "full"]),
    ("olmo3", 2, ["--cp", "2", "--cp-mode", "allgather"]),
    ("olmo3", 2, ["--pp", "2", "--schedule", "zbv", "--zero", "3"]),
]


@pytest.mark.full
@pytest.mark.parametrize("arch,world,flags", LAYOUTS,
                         ids=[f"{arch}-{'-'.join(f.lstrip('-') for f in flags)}" for arch, _, flags in LAYOUTS])
def test_layouts_train_as_one_device_from_the_folder(tmp_path, folders, arch, world, flags):
    argv = [*ARGS, "--init-from", folders[arch]]
    results = run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=300)
    for result in results:
        assert_matches_oracle(result, oracle(argv))
    assert_matches_plan(tmp_path, [*argv, *flags], world)


EXPORTS = [("gpt2", 2, ["--pp", "2"]), ("llama3.2", 2, ["--tp", "2"]), ("llama3.1", 1, []),
           ("mistral", 2, ["--zero", "3"]), ("mistral_window", 2, ["--cp", "2"]), ("qwen2", 2, ["--tp", "2"]),
           ("qwen2_window", 2, ["--tp", "2"]), ("mixtral", 2, ["--ep", "2"]),
           ("llama", 2, ["--pp", "2", "--zero", "1"]), ("qwen3", 2, ["--tp", "2"]),
           ("qwen3_moe", 2, ["--tp", "2", "--ep", "2"]), ("qwen2_moe", 2, ["--tp", "2", "--expert-tp", "2"]),
           ("deepseek_v3", 2, ["--tp", "2"]), ("deepseek_v3_q_proj", 1, []), ("gpt_oss", 2, ["--ep", "2"]),
           ("gemma3_text", 2, ["--tp", "2"]), ("olmo2", 2, ["--tp", "2"]), ("olmo3", 2, ["--pp", "2"])]


@pytest.mark.full
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
    original, exported = hf.read_config(folders[arch]), hf.read_config(out)
    layers = original.get("num_hidden_layers", original.get("n_layer"))
    held = model_tensors(folders[arch], layers)
    assert tensors_of(out).keys() == held.keys()
    for name, expected in held.items():
        assert torch.equal(tensors_of(out)[name], expected), name
    assert exported == original | without_prediction_layers(original) | dict(torch_dtype="float64")


def without_prediction_layers(hf_config):
    """The config.json settings an export changes in a folder with DeepSeek-V3's multi-token-prediction layers:
    it holds none (its num_nextn_predict_layers 0)."""
    return {"num_nextn_predict_layers": 0} if "num_nextn_predict_layers" in hf_config else {}


def model_tensors(folder, n_layer):
    """The tensors of a folder's model of its first n_layer layers: without the later layers, and without
    DeepSeek-V3's multi-token-prediction layers (model.layers.N and on, N its last layer's number + 1), which
    nothing loads."""
    return {name: t for name, t in tensors_of(folder).items()
            if not (m := re.search(r"\.(h|layers)\.(\d+)\.", name)) or int(m.group(2)) < n_layer}


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
                                 ("llama", "mlp_bias", True),
                                 ("qwen2_window", "layer_types", ["chunked_attention"] * 4)]:
        config = hf_models.tiny_config(arch) | {setting: value}
        hf_models.make_folder(str(tmp_path / arch), arch, config=config)
        args = cli.parse_args([*ARGS, "--init-from", str(tmp_path / arch)])
        with pytest.raises(cli.ConfigError, match=setting):
            cli.check_args(args, 1)


DEEPSEEK_EXPERTS = ["--arch", "deepseek", "--experts", "4", "--top-k", "2", "--shared-experts", "1",
                    "--expert-groups", "2", "--group-top-k", "1", "--balance", "bias", "--bias-update-rate", "0.01"]


@pytest.mark.parametrize("model", [["--arch", "gpt"], ["--arch", "llama"], ["--arch", "llama", "--experts", "4"],
                                   ["--arch", "llama", "--sliding-window", "5"], DEEPSEEK_EXPERTS],
                         ids=["gpt2", "llama", "mixtral", "mistral", "deepseek_v3"])
def test_a_run_from_scratch_exports_as_the_matching_architecture(tmp_path, model):
    """A run that did not start from a folder is written as GPT-2, Llama, Mixtral, Mistral (a window on every
    layer) or DeepSeek-V3 (its config made
    here), and the independent reference computes from that folder the logits model.py computes from the
    checkpoint (DeepSeek-V3's: after a step of --balance bias, its routing bias moved, written as
    e_score_correction_bias; its rotated rows interleaved; latent norms of epsilon 1e-6 beside blocks' of 1e-5)."""
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
    exported = hf.read_config(str(tmp_path / "exported"))
    assert exported["architectures"] == [hf.ARCHITECTURES[hf.hf_from_config(config)["model_type"]]]
    if config.kv_lora_rank:
        assert trained.blocks[0].mlp.route_bias.count_nonzero() > 0
        assert exported["rope_interleave"] is True and exported["first_k_dense_replace"] == 0


def test_qwen_settings_model_py_cannot_represent_are_refused_by_name():
    """Qwen3's biases on q, k, v and o but none in its MLP, Qwen3's long-context YaRN scaling (its model card's
    rope_scaling), and exported models no family here computes: a shared expert beside Mixtral's, windows
    where the Qwens (from max_window_layers on) or Mistral (every layer) have none, attention sinks."""
    qwen3 = hf_models.tiny_config("qwen3")
    for config, pattern in [
            (qwen3 | {"attention_bias": True}, "attention_bias"),
            (qwen3 | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
             "rope_scaling.*'yarn'")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.config_from_hf(config, seq_len=16)
    mixtral_like = hf.config_from_hf(hf_models.tiny_config("qwen3_moe"), seq_len=12)
    qwen2, mistral = (hf.config_from_hf(hf_models.tiny_config(arch), seq_len=12) for arch in ("qwen2", "mistral"))
    for config, pattern in [
            (dataclasses.replace(mixtral_like, qk_norm=False, n_shared_experts=1), "shared expert"),
            (dataclasses.replace(qwen2, sliding_window=4, window_layers=(0, 2)), "qwen2 .* a sliding window on these"),
            (dataclasses.replace(mistral, sliding_window=4, window_layers=(1,)), "mistral .* every layer"),
            (dataclasses.replace(qwen2, attention_sinks=True), "attention sinks")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.hf_from_config(config)


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


TIED_ZERO3 = [("qwen3", 2, ["--zero", "3"]),  # Qwen3-0.6B's shape: a tied output layer, one stage
              ("gemma3_text", 2, ["--zero", "3"]),  # Gemma 3's: tied, its embedding scaled
              ("llama3.2", 4, ["--zero", "3", "--dp-shard", "2", "--tp", "2"]),  # hybrid sharding, split by tp
              ("gpt2", 2, ["--zero", "3", "--recompute", "full"])]  # learned positions, the blocks recomputed


@pytest.mark.parametrize("arch,world,flags", TIED_ZERO3, ids=["-".join([a, *(f.lstrip("-") for f in fl)])
                                                              for a, _, fl in TIED_ZERO3])
def test_zero3_gathers_a_tied_output_layer_as_one_weight(tmp_path, folders, arch, world, flags):
    """The embedding's unit lends its weight to the output layer (dp.lend): one weight gathered, reduced and
    stepped, equal to one device, and the plan's counters (the weight counted once, two all-gathers a
    micro-batch as every unit)."""
    argv = [*ARGS, "--init-from", folders[arch]]
    for result in run_on_ranks(world, train_worker, [*argv, *flags, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle(argv))
        state = result["state_dict"]  # (untied, the two would part at the first step: their gradients differ)
        assert torch.equal(state["lm_head.weight"], state["tok_emb.weight"])
    assert_matches_plan(tmp_path, [*argv, *flags], world)


@pytest.mark.full
def test_a_tied_weight_stays_one_through_a_zero3_checkpoint_a_resharded_resume_and_an_export(tmp_path, folders):
    """Qwen3's tied output layer saved by ZeRO-3 (its one weight's shards, under the embedding's name), resumed
    under tp 2 without ZeRO exactly (the two steps after it as one device's), and exported as one tensor, as
    transformers writes a tied model."""
    argv = [*ARGS, "--steps", "4", "--init-from", folders["qwen3"]]
    first = run_on_ranks(2, train_worker, [*argv, "--zero", "3", "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    (run,) = os.listdir(tmp_path / "a")
    saved = checkpoint.checkpoints(str(tmp_path / "a" / run))[0]
    assert "lm_head.weight" not in checkpoint.Checkpoint(saved).tensors
    second = run_on_ranks(2, train_worker, [*argv, "--tp", "2", "--resume", saved, "--out", str(tmp_path / "b")])
    for result in second:
        assert_matches_oracle(dict(losses=first["losses"] + result["losses"], state_dict=result["state_dict"]),
                              reference_run(argv))
    convert.export_hf(saved, str(tmp_path / "exported"))
    assert "lm_head.weight" not in tensors_of(str(tmp_path / "exported"))
    assert hf.read_config(str(tmp_path / "exported"))["tie_word_embeddings"] is True


@pytest.mark.parametrize("arch", ["gpt2", "llama", "deepseek_v3"])
def test_layers_keeps_the_first_blocks_of_a_folder_and_exports_as_such(tmp_path, folders, arch):
    """--layers 2 with --init-from: the model is the folder's first two blocks (a smaller model to check a
    layout with; DeepSeek-V3's dense first layer and a sparse one), its export says two layers and holds those
    blocks' tensors bit for bit; more blocks than the folder has are refused."""
    argv = [*ARGS, "--steps", "1", "--lr", "0", "--init-from", folders[arch], "--layers", "2", "--tp", "2",
            "--out", str(tmp_path)]
    run_on_ranks(2, train_worker, argv, timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path, os.listdir(tmp_path)[0]))[0]
    out = str(tmp_path / "exported")
    convert.export_hf(saved, out)
    layers_key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    original_config = hf.read_config(folders[arch])
    assert hf.read_config(out) == original_config | without_prediction_layers(original_config) \
        | {layers_key: 2, "torch_dtype": "float64"}
    original = tensors_of(folders[arch])
    kept = model_tensors(folders[arch], 2)
    assert tensors_of(out).keys() == kept.keys() and len(kept) < len(original)
    for name, expected in kept.items():
        assert torch.equal(tensors_of(out)[name], expected), name
    with pytest.raises(cli.ConfigError, match="--layers 5: --init-from .* has 4 blocks"):
        cli.check_args(cli.parse_args([*ARGS, "--init-from", folders[arch], "--layers", "5"]), 1)



# ---------------------------------------------------------------------------
# DeepSeek-V3
# ---------------------------------------------------------------------------

def test_a_deepseek_v3_folder_maps_onto_latent_attention_yarn_and_the_grouped_sigmoid_router(folders):
    """Both transformers' forms read as one GPTConfig: latent attention's widths, YaRN (DeepSeek-V3's mscale and
    mscale_all_dim), the first layer dense and the others sparse, the router's groups, scale and correction bias
    (model.py's route_bias buffer); the variant without a query bottleneck reads q_lora_rank 0, from q_proj."""
    v4, v5 = (hf.config_from_hf(hf_models.tiny_config("deepseek_v3", transformers=t), seq_len=12) for t in (4, 5))
    assert v4 == v5
    assert (v4.kv_lora_rank, v4.q_lora_rank, v4.qk_nope_head_dim, v4.qk_rope_head_dim, v4.v_head_dim, v4.head_dim,
            v4.n_kv_heads) == (16, 24, 8, 4, 6, 12, 4)
    assert (v4.rope_type, v4.rope_factor, v4.rope_original_context, v4.rope_beta_fast, v4.rope_beta_slow,
            v4.rope_mscale, v4.rope_mscale_all_dim, v4.max_seq_len) == ("yarn", 4.0, 1024, 32.0, 1.0, 1.0, 1.0, 4096)
    assert (v4.n_experts, v4.moe_layers, v4.d_expert, v4.d_ff, v4.n_shared_experts, v4.d_shared, v4.top_k) \
        == (8, (1, 2, 3), 16, 96, 1, 16, 2)
    assert (v4.router_scoring, v4.n_group, v4.topk_group, v4.routed_scaling_factor, v4.norm_topk_prob) \
        == ("sigmoid", 4, 2, 2.5, True)
    state = hf.load_state_dict(folders["deepseek_v3"], v4)
    routing_bias = tensors_of(folders["deepseek_v3"])["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert torch.equal(state["blocks.2.mlp.route_bias"], routing_bias) and routing_bias.count_nonzero() == 8
    q_proj = hf.config_from_hf(hf_models.tiny_config("deepseek_v3_q_proj"), seq_len=12)
    assert (q_proj.q_lora_rank, q_proj.moe_layers, q_proj.d_shared, q_proj.tie_embeddings) == (0, (), 32, True)
    assert hf.source("deepseek_v3", "blocks.0.attn.q_up.weight", q_proj).names == (
        "model.layers.0.self_attn.q_proj.weight",)


def test_rope_interleave_is_a_permutation_of_the_rotated_rows():
    """With rope_interleave model.py's rows of each head's rotated part (and of the shared rotated key) are the
    folder's in the order 0, 2, 4, ..., 1, 3, 5, ...: its half-split rotation of them is transformers' rotation of
    interleaved pairs. Without it, the folder's order."""
    config = hf.config_from_hf(hf_models.tiny_config("deepseek_v3"), seq_len=12)
    q_up = hf.source("deepseek_v3", "blocks.0.attn.q_up.weight", config)
    kv_down = hf.source("deepseek_v3", "blocks.0.attn.kv_down.weight", config)
    head = list(range(8)) + [8, 10, 9, 11]  # 8 unrotated features, then 4 rotated: pairs (8, 9) and (10, 11)
    assert hf.row_order(q_up, {}, config).tolist() == [12 * h + r for h in range(4) for r in head]
    assert hf.row_order(kv_down, {"rope_interleave": True}, config).tolist() == list(range(16)) + [16, 18, 17, 19]
    assert hf.row_order(kv_down, {"rope_interleave": False}, config) is None


def test_a_dense_deepseek_run_exports_as_deepseek_v3_with_every_layer_dense(tmp_path):
    """--arch deepseek without experts: first_k_dense_replace is every layer (DeepseekV3DecoderLayer builds no MoE),
    the router's settings written as they are, so the config reads back as the run's and the reference, reading
    the folder as transformers does, computes model.py's logits."""
    config = cli.model_config(cli.parse_args([*ARGS, "--arch", "deepseek"]), 64)
    exported = hf.hf_from_config(config)
    assert (exported["model_type"], exported["first_k_dense_replace"], exported["n_routed_experts"]) \
        == ("deepseek_v3", config.n_layer, 0)
    assert exported["rms_norm_eps"] == 1e-5 and exported["rope_scaling"] is None
    assert hf.config_from_hf(exported, seq_len=16) == dataclasses.replace(config, aux_loss_coef=0.01)
    hf_models.make_folder(str(tmp_path), "deepseek_v3", config=json.loads(json.dumps(exported)))
    torch.testing.assert_close(*model_logits(str(tmp_path)), rtol=1e-12, atol=1e-14)


def test_deepseek_v3_settings_model_py_cannot_represent_are_refused_by_name():
    """What transformers' DeepseekV3 and model.py do not compute, or transformers and DeepSeek's own code read
    differently: refused by name, never approximated."""
    v4, v5 = hf_models.tiny_config("deepseek_v3"), hf_models.tiny_config("deepseek_v3", transformers=5)
    yarn = v4["rope_scaling"]
    for config, pattern in [
            (v4 | {"attention_bias": True}, "attention_bias"),
            (v4 | {"hidden_act": "gelu"}, "hidden_act"),
            (v4 | {"topk_method": "group_limited_greedy"}, "topk_method.*softmax"),
            (v4 | {"scoring_func": "softmax"}, "scoring_func"),
            (v4 | {"moe_layer_freq": 2}, "moe_layer_freq"),
            (v4 | {"quantization_config": {"quant_method": "fp8"}}, "quantization_config.*dequantise"),
            (v4 | {"num_key_value_heads": 2}, "num_key_value_heads"),
            (v4 | {"head_dim": 12}, "head_dim"),
            (v4 | {"q_lora_rank": 0}, "q_lora_rank"),
            (v4 | {"n_group": 3}, "group-limited routing"),
            # YaRN's settings that model.py has no field for, or that transformers 4 and 5 read differently
            (v4 | {"rope_scaling": dict(yarn, attention_factor=1.2)}, "rope_scaling.*attention_factor"),
            (v4 | {"rope_scaling": dict(yarn, truncate=0)}, "rope_scaling.*truncate is true .* or false"),
            (v4 | {"max_position_embeddings": 2048}, r"rope_scaling.*2048 / 1024.*transformers 4"),
            (v5 | {"rope_parameters": dict(v5["rope_parameters"], rope_type="llama3")}, "rope_parameters.*'llama3'"),
            (v4 | {"rope_parameters": dict(v5["rope_parameters"], mscale=0.5)}, "rope_scaling=.*rope_parameters=")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.config_from_hf(config, seq_len=12)
    deepseek = hf.config_from_hf(v4, seq_len=12)
    untruncated = hf.config_from_hf(v4 | {"rope_scaling": dict(yarn, truncate=False)}, seq_len=12)  # (gpt-oss's)
    assert untruncated == dataclasses.replace(deepseek, rope_truncate=False)
    assert hf.config_from_hf(hf.hf_from_config(untruncated), seq_len=12) == untruncated
    for changes, pattern in [(dict(router_scoring="softmax"), "softmax router scores"),
                             (dict(moe_layers=(0, 1)), "dense layers after MoE ones"),
                             (dict(max_seq_len=2048), "YaRN with max_seq_len 2048"),
                             (dict(rope_type="llama3"), "llama3 rotary scaling")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.hf_from_config(dataclasses.replace(deepseek, **changes))
    mixtral = hf.config_from_hf(hf_models.tiny_config("mixtral"), seq_len=12)
    with pytest.raises(hf.UnsupportedModel, match="sigmoid router scores.*group-limited routing.*scaled gates"):
        hf.hf_from_config(dataclasses.replace(mixtral, router_scoring="sigmoid", n_group=2, routed_scaling_factor=2.5))


def test_sample_generates_from_a_deepseek_folder_with_a_key_value_cache(folders):
    """tools/sample.py's Hugging Face loading (the routing biases too) and model.py's key/value cache with latent
    attention (each head's keys and values cached expanded): each new token's logits, computed from the cache, are
    those of the whole sequence run again, and the greedy continuation is the same with and without the cache."""
    folder = folders["deepseek_v3"]
    hf_config = hf.read_config(folder)
    config = hf.config_from_hf(hf_config, hf_config["max_position_embeddings"])  # as sample.from_hugging_face
    model = sample.load_hugging_face(folder, config, torch.float64, None, torch.device("cpu"))
    routing_bias = tensors_of(folder)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(model.blocks[1].mlp.route_bias, routing_bias)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    caches = [KVCache() for _ in model.blocks]
    for end in range(6, 13):
        torch.testing.assert_close(model.next_logits(ids[:, :end], caches), model(ids[:, :end])[0][:, -1],
                                   rtol=1e-12, atol=1e-14)
    greedy = sample.continuations(model, ids[0, :6].tolist(), None, 1, 8, temperature=0)
    uncached = model.generate(ids[:1, :6], 8, temperature=0, cache=False)[0, 6:].tolist()
    assert greedy == [uncached]


# ---------------------------------------------------------------------------
# Gemma 3 and OLMo 2 and 3
# ---------------------------------------------------------------------------

_S, _F = "sliding_attention", "full_attention"  # (the kinds of layer, as layer_types and rope_parameters name them)

def test_gemma3_and_olmo_folders_map_onto_their_blocks():
    """Gemma 3's settings as model.py's (Gemma's norm around each sub-layer, GeGLU, the query scale, the scaled
    embedding, the sliding layers' own base unscaled beside the full layers' linear scaling), its multimodal model's
    language model with Gemma3TextConfig's defaults and its old sliding_window_pattern; OLMo 2's norms after the
    sub-layers and QK-norm over each projection, OLMo 3's windows turning unscaled (by the full layers' base) beside
    the full layers' YaRN, its released files' attention_factor read as the one YaRN computes."""
    gemma, multimodal, olmo2, olmo3 = (hf.config_from_hf(hf_models.tiny_config(arch), seq_len=12)
                                       for arch in ("gemma3_text", "gemma3", "olmo2", "olmo3"))
    assert (gemma.norm, gemma.norm_placement, gemma.mlp, gemma.qk_norm_scope, gemma.query_scale, gemma.scale_embedding,
            gemma.tie_embeddings) == ("rms_offset", "sandwich", "geglu", "head", 24, True, True)
    assert (gemma.rope_theta, gemma.rope_type, gemma.rope_factor, gemma.local_rope_theta, gemma.sliding_window,
            gemma.window_layers) == (10000.0, "linear", 4.0, 100.0, 5, (0, 1, 3))
    assert (multimodal.query_scale, multimodal.rope_theta, multimodal.rope_factor, multimodal.local_rope_theta,
            multimodal.window_layers, multimodal.norm_eps) == (256, 1e6, 8.0, 10000.0, (0, 1, 3), 1e-6)
    assert (olmo2.norm, olmo2.norm_placement, olmo2.qk_norm_scope, olmo2.sliding_window, olmo2.tie_embeddings) \
        == ("rms", "post", "projection", 0, False)
    assert (olmo3.window_layers, olmo3.rope_type, olmo3.rope_factor, olmo3.rope_original_context,
            olmo3.local_rope_theta) == ((0, 1, 2), "yarn", 8.0, 16, 500000.0)
    unscaled = hf.config_from_hf(hf_models.tiny_config("olmo3") | {"rope_scaling": None}, seq_len=12)
    assert unscaled.local_rope_theta == 0.0  # (its windowed layers turn as the others do)
    assert hf.source("gemma3", "blocks.1.norm2.weight").names == (
        "model.language_model.layers.1.pre_feedforward_layernorm.weight",)
    assert hf.source("olmo2", "blocks.1.post_norm1.weight").names == ("model.layers.1.post_attention_layernorm.weight",)
    assert not hf.has_source("olmo2", "blocks.1.norm1.weight")


@pytest.mark.parametrize("flags", [["--arch", "gemma3"], ["--arch", "gemma3", "--layers", "4", "--sliding-window", "5",
                                                          "--window-layers", "1:1"],
                                   ["--arch", "olmo2"], ["--arch", "olmo2", "--layers", "4", "--sliding-window", "5",
                                                         "--window-layers", "3:1"]],
                         ids=["gemma3_text", "gemma3_text-windows", "olmo2", "olmo3"])
def test_a_gemma3_or_olmo_model_from_scratch_exports_a_config_that_reads_back_as_itself(tmp_path, flags):
    """--arch gemma3 exports as Gemma 3's language model (without windows: every layer full, the class's window
    kept, which no layer has), --arch olmo2 as OLMo 2, or with windows as OLMo 3; each config reads back as the run's,
    and the reference, reading the folder as transformers does, computes model.py's logits."""
    config = cli.model_config(cli.parse_args([*ARGS, *flags]), 64)
    exported = hf.hf_from_config(config)
    assert exported["model_type"] == ("gemma3_text" if "gemma3" in flags else "olmo3" if config.sliding_window
                                      else "olmo2")
    assert hf.config_from_hf(exported, seq_len=16) == dataclasses.replace(config, aux_loss_coef=0.01)
    hf_models.make_folder(str(tmp_path), exported["model_type"], config=json.loads(json.dumps(exported)))
    torch.testing.assert_close(*model_logits(str(tmp_path)), rtol=1e-12, atol=1e-14)


@pytest.mark.full
def test_a_gemma3_multimodal_folder_exports_its_language_model_as_gemma3_text(tmp_path, folders):
    """Gemma3ForConditionalGeneration's folder, loaded under tp and saved (one step at lr 0), exports its language model
    alone, as Gemma3ForCausalLM's folder: the language model's tensors bit for bit under their text names, none of the
    vision tower's, config.json its text_config with Gemma3TextConfig's defaults written out; the reference computes
    the same logits from both folders."""
    argv = [*ARGS, "--steps", "1", "--lr", "0", "--init-from", folders["gemma3"], "--tp", "2", "--out", str(tmp_path),
            "--vocab-size", "64"]  # (the synthetic language's: the folder's config.json keeps its in text_config)
    run_on_ranks(2, train_worker, argv, timeout=300)
    saved = checkpoint.checkpoints(os.path.join(tmp_path, os.listdir(tmp_path)[0]))[0]
    out = str(tmp_path / "exported")
    convert.export_hf(saved, out)
    language = {name.replace("language_model.model.", "model."): t for name, t in tensors_of(folders["gemma3"]).items()
                if name.startswith("language_model.model.")}
    assert tensors_of(out).keys() == language.keys()
    for name, expected in language.items():
        assert torch.equal(tensors_of(out)[name], expected), name
    original, exported = hf.read_config(folders["gemma3"]), hf.read_config(out)
    assert (exported["model_type"], exported["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert {key: exported[key] for key in original["text_config"]} == original["text_config"]
    assert (exported["query_pre_attn_scalar"], exported["rms_norm_eps"], exported["tie_word_embeddings"]) \
        == (256, 1e-6, True)
    assert hf.config_from_hf(exported, seq_len=12) == hf.config_from_hf(original, seq_len=12)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_models.reference_logits(out, ids), hf_models.reference_logits(folders["gemma3"], ids),
                               rtol=1e-15, atol=1e-15)


def test_gemma3_and_olmo_settings_model_py_cannot_represent_are_refused_by_name(tmp_path):
    """Gemma 2's soft-capping, another activation, EmbeddingGemma's bidirectional attention, biases, sliding layers
    without a window, rotary settings of a kind or form model.py or transformers 4 and 5 read otherwise; a
    multimodal folder whose language model is another or whose two tie_word_embeddings differ, or that holds a vision
    tower alone; OLMo's biases and activation, and OLMo 3's rotary settings that transformers 4 and 5 read apart."""
    gemma, gemma5, multimodal = (hf_models.tiny_config("gemma3_text"), hf_models.tiny_config("gemma3_text", 5),
                                 hf_models.tiny_config("gemma3"))
    olmo2, olmo3, olmo3_5 = hf_models.tiny_config("olmo2"), hf_models.tiny_config("olmo3"), hf_models.tiny_config(
        "olmo3", 5)
    nested = gemma5["rope_parameters"]
    for config, pattern in [
            (gemma | {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: model.py does not cap"),
            (gemma | {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
            (gemma | {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
            (gemma | {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
            (gemma | {"attention_bias": True}, "attention_bias"),
            (gemma | {"sliding_window": None}, "sliding_window=None: its sliding layers have no window"),
            (gemma | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'.*full_attention layers"),
            (gemma5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per kind of layer"),
            (gemma5 | {"rope_parameters": nested | {_S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e2}}},
             "sliding layers' rotation scaled"),
            (gemma | {"rope_parameters": nested | {_F: {"rope_type": "default", "rope_theta": 1e4}}},
             "rope_scaling=.*rope_parameters=.*full_attention layers"),  # (both forms, disagreeing)
            (gemma | {"rope_local_base_freq": 1e4, "rope_parameters": nested}, "rope_theta=10000.0.*sliding_attention"),
            (multimodal | {"text_config": multimodal["text_config"] | {"final_logit_softcapping": 30.0}},
             "final_logit_softcapping"),
            (multimodal | {"text_config": {"model_type": "siglip_text_model"}}, "text_config.*gemma3_text"),
            (multimodal | {"tie_word_embeddings": False}, "tie_word_embeddings=False: its text_config says otherwise"),
            (olmo2 | {"attention_bias": True}, "attention_bias"),
            (olmo2 | {"hidden_act": "gelu"}, "hidden_act"),
            (olmo3 | {"rope_theta": 10000.0}, "rope_theta=10000.0: transformers 4 turns .* 5 by 500,000"),
            (olmo3 | {"rope_scaling": olmo3["rope_scaling"] | {"attention_factor": 1.5}}, "attention_factor of its own"),
            ({k: v for k, v in olmo3.items() if k != "rope_theta"}, "rope_theta=None"),
            (olmo3_5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "per kind of layer"),
            (olmo3 | {"sliding_window": None}, "sliding_window")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.config_from_hf(config, seq_len=12)
    folder = str(tmp_path / "vision")  # (a multimodal folder's vision tower alone)
    hf_models.make_folder(folder, "gemma3")
    vision = {name: t for name, t in tensors_of(folder).items() if not name.startswith("language_model.")}
    save_file(vision, os.path.join(folder, "model.safetensors"))
    config = hf.config_from_hf(hf.read_config(folder), seq_len=12)
    with pytest.raises(hf.UnsupportedModel, match="no tensor model.language_model.embed_tokens.weight"):
        hf.HuggingFaceValues(folder, config).check_shapes()


def test_exported_models_gemma3_or_olmo_cannot_hold_are_refused_by_name():
    """What Gemma 3's, OLMo 2's and OLMo 3's modeling code does not compute, and Gemma's and OLMo's pieces in the other
    families: refused by name, never written as something else."""
    gemma, olmo2, olmo3, llama, qwen3, mistral = (hf.config_from_hf(hf_models.tiny_config(arch), seq_len=12) for arch in
                                                  ("gemma3_text", "olmo2", "olmo3", "llama", "qwen3", "mistral_window"))
    for config, pattern in [
            (dataclasses.replace(gemma, mlp="swiglu"), "gemma3_text is the nearest, but has not the swiglu MLP"),
            (dataclasses.replace(gemma, norm_placement="pre"), "norms before each sub-layer"),
            (dataclasses.replace(gemma, qk_norm=False), "attention without QK-norm of each head"),
            (dataclasses.replace(gemma, scale_embedding=False), "an unscaled embedding"),
            (dataclasses.replace(gemma, rope_type="llama3"), "llama3 rotary scaling"),
            (dataclasses.replace(gemma, local_rope_theta=0.0), "windowed layers whose rotation is scaled"),
            (dataclasses.replace(olmo3, local_rope_theta=0.0), "olmo3 .* windowed layers whose rotation is scaled"),
            (dataclasses.replace(olmo3, local_rope_theta=1e4), "olmo3 .* a base of their own"),
            (dataclasses.replace(olmo3, rope_theta=1e4, local_rope_theta=1e4), "rope_theta other than 500,000"),
            (dataclasses.replace(olmo3, max_seq_len=256), "olmo3 .* YaRN with max_seq_len 256"),
            (dataclasses.replace(olmo2, qk_norm_scope="head"), "olmo2 .* QK-norm of each head"),
            (dataclasses.replace(olmo2, qk_norm=False), "olmo2 .* attention without QK-norm"),
            (dataclasses.replace(llama, mlp="geglu"), "llama .* GeGLU"),
            (dataclasses.replace(llama, norm_placement="sandwich"), "norms before and after each sub-layer"),
            (dataclasses.replace(llama, scale_embedding=True), "a scaled embedding"),
            (dataclasses.replace(llama, query_scale=24), "a query scale"),
            (dataclasses.replace(qwen3, qk_norm_scope="projection"), "qwen3 .* QK-norm over the whole projection"),
            (dataclasses.replace(mistral, local_rope_theta=100.0), "mistral .* turning by a base of their own")]:
        with pytest.raises(hf.UnsupportedModel, match=pattern):
            hf.hf_from_config(config)
