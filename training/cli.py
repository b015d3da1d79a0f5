"""train.py's command line: model presets, the flags' parser, and the checks that refuse a run before it trains.

Each check raises ConfigError, with a message naming the flags at fault, on every rank alike: check_args
before any process group exists (tools/plan/ asks it too, for the layouts it predicts), so a bad launch ends
at once instead of hanging; check_tokens once the data is loaded, before the first step. The data's
meta.json is read once (describe_data), and its record passed to every check and to the data opened.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist

import cp
import pp
import tp
from mesh import mesh_shape
from model import GPTConfig, pad_vocabulary
from training import dashboard, hf, hub
from training.data import DataInfo
from training.profile import profiled_steps
from training.tokenizer import fingerprint

PRESETS = {  # model shapes; vocab_size is the synthetic language's (real data brings its own)
    "tiny": dict(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=64),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=64, vocab_size=256),
    "medium": dict(n_layer=8, n_head=8, d_model=256, seq_len=256, vocab_size=256),
    # GPU sizes: GPT-2 small (124M) and medium (350M), with GPT-2's vocabulary padded to 50304.
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50304),
    # Today's shapes, with --arch llama (their key/value heads, SwiGLU width and rotary base are below);
    # for planning them (tools/plan/) more than for training them here. Mixtral 8x7B is mixtral with
    # --experts 8 --top-k 2; deepseek-v3 (with --arch deepseek) is DeepSeek-V3 671B whole (DEEPSEEK_SHAPES).
    "llama3-8b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=8192, vocab_size=128256),
    "llama3-70b": dict(n_layer=80, n_head=64, d_model=8192, seq_len=8192, vocab_size=128256),
    "llama3-405b": dict(n_layer=126, n_head=128, d_model=16384, seq_len=8192, vocab_size=128256),
    "mixtral": dict(n_layer=32, n_head=32, d_model=4096, seq_len=4096, vocab_size=32000),
    "deepseek-v3": dict(n_layer=61, n_head=128, d_model=7168, seq_len=4096, vocab_size=129280),
    # gpt-oss-20b and -120b whole (with --arch gpt-oss; GPT_OSS_SHAPES), trained here at 4,096 tokens: the
    # context its YaRN stretches 32 times (rope_scaling's original_max_position_embeddings, its pretraining's).
    "gpt-oss-20b": dict(n_layer=24, n_head=64, d_model=2880, seq_len=4096, vocab_size=201088),
    "gpt-oss-120b": dict(n_layer=36, n_head=64, d_model=2880, seq_len=4096, vocab_size=201088),
    # Gemma 3 1B and 27B's language models (with --arch gemma3; GEMMA3_SHAPES), and OLMo 2 7B (--arch olmo2),
    # whole, at their pretraining's sequence lengths.
    "gemma3-1b": dict(n_layer=26, n_head=4, d_model=1152, seq_len=32768, vocab_size=262144),
    "gemma3-27b": dict(n_layer=62, n_head=32, d_model=5376, seq_len=8192, vocab_size=262208),
    "olmo2-7b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=4096, vocab_size=100352),
}
# The Llama-style block (--arch llama): rotary positions, grouped-query attention, RMSNorm, SwiGLU, no
# biases; per size, the key/value heads and a SwiGLU width of about 8/3 d_model (Llama's, rounded up),
# which keeps the MLP's parameters those of GPT's 4 d_model GELU MLP.
LLAMA = dict(position="rope", norm="rms", mlp="swiglu", bias=False)
LLAMA_SHAPES = {
    "tiny": dict(n_kv_heads=2, d_ff=96), "small": dict(n_kv_heads=2, d_ff=352),
    "medium": dict(n_kv_heads=2, d_ff=704), "gpt2": dict(n_kv_heads=4, d_ff=2048),
    "gpt2-medium": dict(n_kv_heads=4, d_ff=2816),
    "llama3-8b": dict(n_kv_heads=8, d_ff=14336, rope_theta=500000.0),
    "llama3-70b": dict(n_kv_heads=8, d_ff=28672, rope_theta=500000.0),
    "llama3-405b": dict(n_kv_heads=8, d_ff=53248, rope_theta=500000.0),
    "mixtral": dict(n_kv_heads=8, d_ff=14336, rope_theta=1000000.0),
}
# DeepSeek-V3's block (--arch deepseek): the Llama block with multi-head latent attention (model.py's
# LatentAttention), and in its MoE layers (--experts) DeepSeek-V3's router: sigmoid scores, gates scaled by
# 2.5. Per size, the latent's and the heads' widths; deepseek-v3 is the whole model: its first 3 layers
# dense, 256 routed experts in 8 groups (a token's 8 from its best 4 groups) and a shared one, YaRN from
# 4,096 to 163,840 positions (its config.json's).
DEEPSEEK = dict(LLAMA, router_scoring="sigmoid", routed_scaling_factor=2.5)
DEEPSEEK_SHAPES = {
    "tiny": dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, d_ff=96),
    "small": dict(q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, d_ff=352),
    "medium": dict(q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                   d_ff=704),
    "deepseek-v3": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, d_ff=18432, n_experts=256, top_k=8, n_shared_experts=1, d_expert=2048,
                        n_group=8, topk_group=4, moe_layers=tuple(range(3, 61)), rope_theta=10000.0,
                        rope_type="yarn", rope_factor=40.0, rope_original_context=4096, rope_mscale=1.0,
                        rope_mscale_all_dim=1.0, max_seq_len=163840),
}
# gpt-oss's block (--arch gpt-oss): the Llama block with biases on q, k, v and o, a sink per head, gpt-oss's
# clamped SwiGLU, and in its MoE layers (--experts) a router with a bias, its top-k softmaxed (Mixtral's
# renormalised softmax, the same gates); YaRN as its config.json has it (x32 over 4,096 positions, the ramp's
# ends not rounded). Its windows are flags at the small sizes (--sliding-window 128 --window-layers 1:1, as its
# layer_types); the whole models below have them.
GPT_OSS = dict(LLAMA, bias=True, attention_sinks=True, mlp="clamped_swiglu", router_bias=True, rope_theta=150000.0,
               rope_type="yarn", rope_factor=32.0, rope_original_context=4096, rope_truncate=False, max_seq_len=131072)
# Per size, Llama's for the small ones; gpt-oss-20b and -120b are the released models whole (OpenAI's
# config.json): 64 query heads of 64 features (wider than d_model / heads) over 8 key/value heads, in every
# layer experts of 2,880 (the top 4 of 32 or 128), a window of 128 tokens on every second layer from the first.
GPT_OSS_WHOLE = dict(n_kv_heads=8, head_dim=64, d_ff=2880, top_k=4, sliding_window=128)
GPT_OSS_SHAPES = {
    **{size: LLAMA_SHAPES[size] for size in ("tiny", "small", "medium")},
    "gpt-oss-20b": dict(GPT_OSS_WHOLE, n_experts=32, window_layers=tuple(range(0, 24, 2))),
    "gpt-oss-120b": dict(GPT_OSS_WHOLE, n_experts=128, window_layers=tuple(range(0, 36, 2))),
}
# Gemma 3's block (--arch gemma3): rotary positions, grouped-query attention, Gemma's (1 + w) RMSNorms before
# and after each sub-layer, QK-norm of the same kind, a GeGLU MLP, no biases, the embedding scaled by
# sqrt(d_model) and tied to the output layer; its windowed layers rotate by a base of 10,000, the others by
# 1,000,000 (27B: 8 times slower, linear scaling). Its windows are flags at the small sizes (--sliding-window 8
# --window-layers 5:1, as its layer_types); the whole models have them. The small sizes score by 1/sqrt of
# d_model / heads with heads wider than that, as 27B does (query_pre_attn_scalar 168, heads of 128).
GEMMA3 = dict(position="rope", norm="rms_offset", norm_placement="sandwich", mlp="geglu", bias=False, qk_norm=True,
              scale_embedding=True, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6, local_rope_theta=10000.0)
GEMMA3_SHAPES = {
    "tiny": dict(n_kv_heads=2, head_dim=16, query_scale=8, d_ff=96),
    "small": dict(n_kv_heads=2, head_dim=64, query_scale=32, d_ff=352),
    "medium": dict(n_kv_heads=2, head_dim=64, query_scale=32, d_ff=704),
    "gemma3-1b": dict(n_kv_heads=1, head_dim=256, query_scale=256, d_ff=6912, sliding_window=512,
                      window_layers=tuple(i for i in range(26) if i % 6 < 5), max_seq_len=32768),
    "gemma3-27b": dict(n_kv_heads=16, head_dim=128, query_scale=168, d_ff=21504, sliding_window=1024,
                       window_layers=tuple(i for i in range(62) if i % 6 < 5), rope_type="linear", rope_factor=8.0,
                       max_seq_len=131072),
}
# OLMo 2's block (--arch olmo2): the Llama block with its RMSNorms after each sub-layer, inside the residual
# branch, and none before; QK-norm over the whole q and k projections. OLMo 3 is it with windows on three
# layers of four (--sliding-window --window-layers 3:1).
OLMO2 = dict(LLAMA, norm_placement="post", qk_norm=True, qk_norm_scope="projection", rope_theta=500000.0)
OLMO2_SHAPES = {
    **{size: LLAMA_SHAPES[size] for size in ("tiny", "small", "medium")},
    "olmo2-7b": dict(n_kv_heads=32, d_ff=11008, norm_eps=1e-6),
}
ARCHS = {"gpt": ({}, {}), "llama": (LLAMA, LLAMA_SHAPES), "deepseek": (DEEPSEEK, DEEPSEEK_SHAPES),
         "gpt-oss": (GPT_OSS, GPT_OSS_SHAPES), "gemma3": (GEMMA3, GEMMA3_SHAPES), "olmo2": (OLMO2, OLMO2_SHAPES)}
# Shapes that exist only as Llama (or DeepSeek) blocks:
LLAMA_ONLY = ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral")
# Presets that are one architecture's whole model, and that architecture:
WHOLE_MODELS = {"deepseek-v3": ("deepseek", "DeepSeek-V3"), "gpt-oss-20b": ("gpt-oss", "gpt-oss"),
                "gpt-oss-120b": ("gpt-oss", "gpt-oss"), "gemma3-1b": ("gemma3", "Gemma 3"),
                "gemma3-27b": ("gemma3", "Gemma 3"), "olmo2-7b": ("olmo2", "OLMo 2")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class ConfigError(ValueError):
    """A combination of flags (or data) that cannot run; raised on every rank alike, before training."""


def parse_args(argv=None):
    args = argument_parser().parse_args(argv)
    args.seq_len = args.seq_len or PRESETS[args.model]["seq_len"]
    args.layers = args.layers or (None if args.init_from else PRESETS[args.model]["n_layer"])
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.virtual_stages = args.virtual_stages or pp.CHUNKS_A_RANK.get(args.schedule, 1)
    args.master_dtype = args.master_dtype or ("float32" if args.dtype == "bfloat16" else args.dtype)
    args.reduce_dtype = args.reduce_dtype or args.master_dtype
    return args


def argument_parser():
    """train.py's command line (parse_args reads it and fills in the defaults that depend on other flags)."""
    p = argparse.ArgumentParser(prog="train.py",
                                description="Train the GPT of model.py on any mix of parallel dimensions.")
    p.add_argument("--model", choices=PRESETS, default="small", help="model size preset")
    p.add_argument("--arch", choices=ARCHS, default="gpt",
                   help="gpt: GPT-2's block (learned positions, LayerNorm, GELU, biases); llama: rotary positions, "
                        "grouped-query attention, RMSNorm, SwiGLU, no biases; deepseek: llama's with DeepSeek's "
                        "multi-head latent attention and, in MoE layers, DeepSeek-V3's sigmoid router (see "
                        "docs/deepseek.md)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads of grouped-query attention (default: all heads with --arch gpt, the "
                        "preset's with --arch llama)")
    # The model's shape over the preset's, e.g. torchtitan's Llama 3 debug model: --model tiny --arch llama
    # --d-model 256 --layers 6 --heads 16 --kv-heads 16 --d-ff 768 --vocab-size 2048
    p.add_argument("--d-model", type=int, default=None, help="the residual stream's width (default: the preset's)")
    p.add_argument("--heads", type=int, default=None, help="attention (query) heads (default: the preset's)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="features of a head (default: --d-model / --heads; Qwen3 and Mistral NeMo have wider ones)")
    p.add_argument("--d-ff", type=int, default=None,
                   help="the MLP's hidden width (default: the preset's; with --arch gpt, 4 x --d-model)")
    p.add_argument("--qk-norm", action="store_true",
                   help="QK-norm: an RMSNorm of each head's queries and keys before the rotation (Qwen3, OLMo 2)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="a query sees at most the W latest tokens, itself included (Mistral, Gemma 3, gpt-oss), on "
                        "the layers --window-layers names (default: every layer)")
    p.add_argument("--window-layers", default=None, metavar="LAYERS",
                   help="which layers have the --sliding-window: their indices (0,2,4), or LOCAL:GLOBAL, runs of "
                        "LOCAL windowed layers each followed by GLOBAL full ones (Gemma 3's 5:1, gpt-oss's 1:1)")
    p.add_argument("--attention-sinks", action="store_true",
                   help="a learned logit per head in every attention softmax's denominator (gpt-oss)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face model folder's weights (GPT-2, Llama, Mistral, Mixtral, Qwen2, "
                        "Qwen3, the Qwen MoEs, DeepSeek-V3), or a hub id's (owner/name[@revision]: huggingface_hub, "
                        "if installed, downloads it into its cache): its config.json sets the model (not --model, "
                        "--arch, --kv-heads; --d-model, --heads, --head-dim, --d-ff and --qk-norm are refused; "
                        "--layers N keeps its first N blocks, a smaller model to check a layout with); see "
                        "training/hf.py and training/hub.py")
    p.add_argument("--batch-size", type=int, default=32,
                   help="global batch in sequences, split over data ranks and micro-batches")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient-accumulation micro-batches per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr (cosine)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon for the blocks' matrices, AdamW for the rest (training/muon.py)")
    p.add_argument("--muon-assembly", choices=("owner", "gather"), default="owner",
                   help="how Muon assembles a matrix split across ranks: one owner each, or every holder")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--skip-nonfinite-steps", type=int, default=0,
                   help="steps whose gradient norm is not finite that may be skipped (no update) before the "
                        "run stops; 0: the first one stops it")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the weights', activations' and every message's dtype (float64 for checks); bfloat16 "
                        "trains as Megatron-LM and FSDP2 do, with float32 master weights and reduction")
    p.add_argument("--fp8", choices=("rowwise", "tensorwise"), default=None,
                   help="the blocks' linear layers compute in float8 by this recipe (training/fp8.py): rowwise "
                        "scales, the same under every layout, or one scale a tensor; on a GPU with --dtype bfloat16")
    p.add_argument("--master-dtype", choices=DTYPES, default=None,
                   help="the optimizer's weights and moments (default: float32 under bfloat16, else --dtype)")
    p.add_argument("--reduce-dtype", choices=DTYPES, default=None,
                   help="the gradients' accumulation over micro-batches and reduction over data ranks "
                        "(default: --master-dtype; bfloat16 halves the reduction's traffic)")
    p.add_argument("--record-collectives", type=int, default=2000, metavar="N",
                   help="each rank keeps a record of its last N collectives and writes it into the run folder "
                        "if the run fails, times out or is stopped, for python -m tools.diagnose (0: none; "
                        "default %(default)s)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the logged scalars for TensorBoard into the run's tensorboard/ (needs the "
                        "tensorboard package, which the project does not install)")
    p.add_argument("--data", default=None, help="a token directory (python -m tools.prepare's, or nanoGPT's "
                                                "train.bin/val.bin), a text file read as bytes, or a weighted "
                                                "mixture of token directories: A:0.7,B:0.3 or a JSON file "
                                                "{\"A\": 0.7, \"B\": 0.3} (default: the synthetic Markov language)")
    p.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="packed documents: attention and positions stop at each EOS and the prediction across it "
                        "is not trained (default: on when the data declares its EOS id, as tools.prepare's does, "
                        "or --eos-id gives one)")
    p.add_argument("--eos-id", type=int, default=None,
                   help="the id that ends each document (default: the data's meta.json's; for nanoGPT's GPT-2 ids, "
                        "50256)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary of the synthetic language (default: the preset's), or of a token directory "
                        "without meta.json or meta.pkl (default: GPT-2's 50257)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device, for model FLOPs utilisation (default: known GPUs' table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs", help="runs are written to OUT/<name>/")
    p.add_argument("--name", default=None, help="run name (default: gpuN_tpX_ppY_cpZ_epW)")
    p.add_argument("--eval-interval", type=int, default=50, help="steps between validation losses")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=10, help="steps between printed lines")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="steps between checkpoints (0: end only)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective may wait for a rank before the run stops with an error "
                        "(a dead or stalled peer); torchrun --max-restarts then restarts it")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many of the newest checkpoints to keep")
    p.add_argument("--resume", default=None,
                   help="a checkpoint to resume from, or 'auto': the newest good one of this run, if any")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps (checkpoint written), as if preempted; resume with --resume")
    p.add_argument("--profile", default=None, metavar="STEPS",
                   help="trace these steps, counted from 0 as the log counts them (3, or 5-7): one Chrome trace per "
                        "rank in the run's traces/ (and on CUDA the allocator's memory in memory/), for Perfetto; "
                        "see docs/diagnosing.md")
    p.add_argument("--deterministic", action="store_true",
                   help="on GPUs, the settings under which a run repeats bit for bit (deterministic kernels, "
                        "cuBLAS's workspace, NCCL's algorithm; training/determinism.py), recorded in config.json; on "
                        "CPUs a run repeats already")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="data-parallel gradient bucket size")
    p.add_argument("--experts", type=int, default=None,
                   help="experts per MoE layer (0: dense MLPs; default: the preset's, 0 but for deepseek-v3 and "
                        "gpt-oss-*)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: the preset's, else 2)")
    p.add_argument("--shared-experts", type=int, default=None,
                   help="experts' widths of an MLP every token passes through besides its top-k (DeepSeek-MoE)")
    p.add_argument("--expert-groups", type=int, default=None,
                   help="DeepSeek-V3's group-limited routing: the experts in this many equal groups, a token's "
                        "top-k from its --group-top-k best groups (default: the preset's, else 1)")
    p.add_argument("--group-top-k", type=int, default=None, help="groups a token's experts come from")
    p.add_argument("--balance", choices=("aux", "bias", "both"), default="aux",
                   help="expert balancing: the Switch auxiliary loss, DeepSeek-V3's routing bias, or both")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--aux-loss-scope", choices=("batch", "sequence", "global"), default="batch",
                   help="the auxiliary loss balances each micro-batch (Switch), each sequence (DeepSeek-V3), or "
                        "the micro-batch by the experts' shares of the whole global batch (Qwen's; the previous "
                        "step's: docs/design-ep.md)")
    p.add_argument("--bias-update-rate", type=float, default=1e-3,
                   help="step of the routing bias towards balance after every training step (--balance bias, both)")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="an expert takes at most this x its fair share of a rank's tokens (0: dropless)")
    p.add_argument("--ep-overlap", type=int, default=0, metavar="CHUNKS",
                   help="the experts' all-to-alls beside their computation: the routed tokens in this many chunks, "
                        "each dispatched, computed and combined on its own (0: one exchange each way, waited for)")
    for dim, help_ in [("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")]:
        p.add_argument(f"--{dim}", type=int, default=1, help=f"{help_}-parallel size")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: the experts spread over this many of each pipeline stage's "
                        "dp x cp x tp ranks (folded over them, not multiplying the world)")
    p.add_argument("--expert-tp", type=int, default=1,
                   help="tensor parallelism inside each expert, over this many of the stage's ranks (1: whole "
                        "experts, as DeepSeek-V3)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--dp-shard", type=int, default=0,
                   help="hybrid sharding: ZeRO's shards span groups of this many neighbouring data-parallel ranks "
                        "(a node), copies across the groups (0: all data-parallel ranks)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--cp-mode", choices=sorted(cp.MODES), default="ring",
                   help="how context parallelism splits attention: ring attention, all-gathered keys and values, "
                        "or an all-to-all to head shards (DeepSpeed-Ulysses)")
    p.add_argument("--schedule", choices=sorted(pp.SCHEDULES), default="1f1b", help="pipeline schedule")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved schedule, default 2; zbv: 2; else 1)")
    p.add_argument("--pp-debug", action="store_true", help="print every pipeline send and receive")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation: full (each block keeps only its input), selective (the "
                        "attention core only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block's computation (its parallel communication stays eager)")
    return p



def check_fp8(args):
    """--fp8 on a GPU: one with float8 matrix units (compute capability 8.9: Ada, Hopper, Blackwell), in
    bfloat16 (the rowwise products' only output dtype there). On CPUs any dtype (float64 for the checks)."""
    if not args.fp8 or not torch.cuda.is_available():
        return
    if torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError(f"--fp8 needs a GPU with float8 matrix units (compute capability 8.9 or later); this "
                          f"one, {torch.cuda.get_device_name()}, has {torch.cuda.get_device_capability()}")
    if args.dtype != "bfloat16":
        raise ConfigError(f"--fp8 on a GPU trains with --dtype bfloat16, not {args.dtype}")


def check_args(args, world, data=None):
    """(the model config, the mesh's shape) these flags describe on `world` ranks, or a ConfigError saying
    what is wrong. With --init-from the folder's config.json sets the model (its layers, experts, top-k),
    whatever --layers, --experts and --top-k say. data: the training data's DataInfo where the caller has
    read it (train.py, which passes it on), else it is read here (describe_data)."""
    check_numbers(args)
    data = data or describe_data(args)
    check_data(args, data)
    check_tokenizer(args, data)
    config = model_config(args, data.vocab_size)
    document_eos(args, config.vocab_size, data)
    check_experts(args, config)
    try:
        shape = mesh_shape(world, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, expert_tp=args.expert_tp,
                           dp_shard=args.dp_shard)
    except ValueError as e:
        raise ConfigError(resumed_world_problem(args, world) or str(e)) from None
    if args.dp_shard and not args.zero:
        raise ConfigError(f"--dp-shard {args.dp_shard} shards ZeRO's state within groups of data-parallel ranks: "
                          f"it needs --zero 1, 2 or 3 (without ZeRO every rank holds everything)")
    if args.muon_assembly != "owner" and args.optimizer != "muon":
        raise ConfigError(f"--muon-assembly {args.muon_assembly} is how Muon assembles its matrices: it needs "
                          f"--optimizer muon")
    n_data = shape.dp
    for flag, value in [("--batch-size", args.batch_size), ("--micro-batches", args.micro_batches),
                        ("--steps", args.steps), ("--seq-len", args.seq_len), ("--eval-batches", args.eval_batches),
                        ("--eval-interval", args.eval_interval), ("--log-interval", args.log_interval)]:
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    check_profile(args)
    check_fp8(args)
    if args.tensorboard and not dashboard.available():
        raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard): the project "
                          "does not depend on it otherwise")
    if args.batch_size % (args.micro_batches * n_data):
        raise ConfigError(resumed_world_problem(args, world) or
                          f"--batch-size {args.batch_size} must divide into --micro-batches {args.micro_batches} "
                          f"x {n_data} data ranks (a multiple of {args.micro_batches * n_data})")
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise ConfigError(f"--cp {args.cp}: --seq-len {args.seq_len} must divide into 2 x {args.cp} chunks "
                          f"(each rank holds an early and a late chunk, for load balance)")
    if DTYPES[args.master_dtype].itemsize < DTYPES[args.dtype].itemsize:
        raise ConfigError(f"--master-dtype {args.master_dtype} is narrower than --dtype {args.dtype}: the "
                          f"optimizer's copy of the weights must hold at least what the weights hold")
    if args.sp and args.tp == 1:
        raise ConfigError("--sp (sequence parallelism) splits the sequence over the tensor-parallel group: "
                          "it needs --tp > 1")
    check_pipeline(args, config.n_layer)
    if args.tp > 1:
        problem = tp.check_tensor_parallel(args.tp, config.n_head, config.d_ff, config.padded_vocab_size,
                                           args.seq_len // args.cp if args.sp else None, config.n_kv_heads)
        if problem:
            raise ConfigError(f"--tp {args.tp}: {problem}")
    if args.cp > 1 and args.cp_mode == "alltoall":
        heads, kv_heads = config.n_head // args.tp, config.n_kv_heads // args.tp
        if heads % args.cp or kv_heads % args.cp:
            raise ConfigError(f"--cp-mode alltoall gives each of --cp {args.cp} ranks whole heads: {heads} query "
                              f"and {kv_heads} key/value heads a tensor-parallel rank do not divide by {args.cp}")
    if data.vocab_size > config.vocab_size:
        raise ConfigError(f"the data's vocabulary ({data.vocab_size} ids) is larger than the model's "
                          f"({config.vocab_size}, from --init-from {args.init_from})")
    return config, shape


def fits(args, world):
    """Whether `world` ranks hold the layout: the mesh (tp x pp x cp dividing it, and ep's folds) and the
    global batch split over its data ranks and --micro-batches."""
    try:
        shape = mesh_shape(world, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, expert_tp=args.expert_tp,
                           dp_shard=args.dp_shard)
    except ValueError:
        return False
    return args.batch_size % (args.micro_batches * shape.dp) == 0


def resumed_world_problem(args, world):
    """What to say, in one line, when a resumed run's world cannot hold its layout, or None (not resumed, or
    no world would hold it: the plain message says why).

    A node lost for good under torchrun --nnodes MIN:MAX restarts the survivors as a smaller world with the
    same flags: tp, pp and cp are kept, dp takes what is left, and the global batch must still split over
    the data ranks and the micro-batches. The worlds that would hold it are named: up to `world`, or else
    the smallest one larger."""
    if not args.resume or args.batch_size < 1 or args.micro_batches < 1:
        return None
    per_copy = args.tp * args.pp * args.cp
    layout = (f"tp x pp x cp = {args.tp} x {args.pp} x {args.cp} = {per_copy} ranks hold a copy of the model, and "
              f"--batch-size {args.batch_size} splits over --micro-batches {args.micro_batches} x the data ranks")
    smaller = [w for w in range(world - 1, 0, -1) if fits(args, w)]
    if smaller:
        would = ", ".join(f"{w} ranks (dp {w // per_copy})" for w in smaller[:3])
        return (f"--resume {args.resume} on {world} ranks: the resumed world is too small for the layout, or of a "
                f"size it does not divide into ({layout}); smaller worlds that hold it: {would}")
    larger = next((w for w in range(world + 1, per_copy * args.batch_size + 1) if fits(args, w)), None)
    if larger is None:
        return None
    return (f"--resume {args.resume} on {world} ranks: the resumed world is too small for the layout ({layout}); "
            f"the smallest that holds it is {larger} ranks (dp {larger // per_copy})")


def check_experts(args, config):
    """The mixture-of-experts flags against the model's experts (--experts, or the --init-from folder's)."""
    experts = config.n_experts
    if args.ep > 1 and not experts:
        raise ConfigError("--ep spreads the experts of MoE layers: it needs --experts")
    if args.expert_tp > 1 and not experts:
        raise ConfigError("--expert-tp splits the experts of MoE layers: it needs --experts")
    if experts and experts % args.ep:
        raise ConfigError(f"--experts {experts} do not divide over --ep {args.ep} ranks")
    if experts and config.d_expert % args.expert_tp:
        raise ConfigError(f"--expert-tp {args.expert_tp}: an expert's hidden size {config.d_expert} does not divide "
                          f"by it")
    if experts and config.d_shared % args.tp:  # tp splits the shared expert as it splits a dense MLP
        raise ConfigError(f"--tp {args.tp}: the shared expert's hidden size {config.d_shared} does not divide by it")
    if not 0 <= args.capacity_factor < math.inf or (args.capacity_factor and not experts):
        raise ConfigError("--capacity-factor must be positive and needs --experts")
    if args.ep_overlap < 0 or (args.ep_overlap and not experts):
        raise ConfigError("--ep-overlap is a number of chunks (0: no overlap) and needs --experts")
    if args.schedule == "combined" and args.ep_overlap != 1:
        raise ConfigError("--schedule combined pairs micro-batches so that one's experts' all-to-alls travel while "
                          "the other computes: it needs --experts and --ep-overlap 1 (each exchange started whole, "
                          "then waited for; the tokens in more chunks besides are not supported)")
    if not experts and (args.shared_experts or args.balance != "aux" or args.aux_loss_scope != "batch"):
        raise ConfigError("--shared-experts, --balance and --aux-loss-scope shape mixture-of-experts layers: they "
                          "need --experts")


def check_numbers(args):
    """The real-valued flags finite and in range: a NaN, an infinite or a negative --lr would otherwise end in
    the optimizer's traceback, or train to NaN; a negative --grad-clip would turn the gradients around."""
    for flag, value in [("--lr", args.lr), ("--min-lr-ratio", args.min_lr_ratio), ("--warmup", args.warmup),
                        ("--weight-decay", args.weight_decay), ("--grad-clip", args.grad_clip),
                        ("--aux-loss-coef", args.aux_loss_coef), ("--bias-update-rate", args.bias_update_rate),
                        ("--bucket-mb", args.bucket_mb), ("--peak-tflops", args.peak_tflops or 0.0),  # (None: the GPUs')
                        ("--record-collectives", args.record_collectives)]:
        if not 0 <= value < math.inf:
            raise ConfigError(f"{flag} must be a finite number, at least 0, got {value}")
    if not 0 < args.timeout < math.inf:
        raise ConfigError(f"--timeout must be a finite number of seconds, more than 0, got {args.timeout}")


def check_profile(args):
    """--profile's steps: one step or a range, each a step this run has (counted from 0, as the log counts)."""
    if args.profile is None:
        return
    try:
        _, last = profiled_steps(args.profile)
    except ValueError:
        raise ConfigError(f"--profile {args.profile}: give a step or a range of steps, counted from 0, e.g. 3 or "
                          f"5-7") from None
    if last >= args.steps:
        raise ConfigError(f"--profile {args.profile}: the run has --steps {args.steps}, steps 0 to {args.steps - 1}")


def describe_data(args):
    """The training data's DataInfo: its meta.json (or meta.pkl) read here, once for the whole configuration.
    Data that cannot be read (missing, a broken meta.json) fails here, not mid-run.

    The first of the flags' files read, whatever the caller (train.py, tools/parity.py, plan, dryrun): a hub
    id given as --init-from (openai/gpt-oss-20b) becomes its folder in huggingface_hub's cache here, for every
    later use (training/hub.py: downloaded where it is not there yet; parsing the flags reads no file)."""
    args.init_from = hub.resolve(args.init_from, "model", lambda e: ConfigError(f"--init-from {e}"))
    vocab_size = args.vocab_size if args.data else synthetic_vocab_size(args)
    try:
        return DataInfo.read(args.data, vocab_size)
    except FileNotFoundError:
        raise ConfigError(f"--data {args.data}: no such file or directory ({args.data})") from None
    except ValueError as e:  # a meta.json that cannot be read
        raise ConfigError(str(e)) from None


def check_data(args, data):
    """--data that cannot train (empty, shorter than one sequence, a split missing) fails here, not mid-run."""
    if args.data is None:
        return
    try:
        lengths = data.split_lengths()
    except FileNotFoundError as e:
        raise ConfigError(f"--data {args.data}: no such file or directory ({e.filename})") from None
    except ValueError as e:  # a token file of a size that is not its meta.json's, or not whole tokens
        raise ConfigError(str(e)) from None
    for split, n_tokens in lengths.items():
        if n_tokens < args.seq_len + 1:
            raise ConfigError(f"--data {args.data}: the {split} split has {n_tokens} tokens, fewer than one "
                              f"sequence of --seq-len {args.seq_len} plus its last target")


def check_tokenizer(args, data):
    """A released model (--init-from) reads its own tokenizer's ids: --data tokenized by another tokenizer, or a
    text file (read as bytes, ids 0 to 255), would train it on ids that mean other tokens, without a word."""
    if args.init_from is None or args.data is None:
        return
    prepare = f"python -m tools.prepare --tokenizer {args.init_from} --out DIR YOUR_TEXT"
    for source in [info for info, _ in data.sources] or [data]:  # a mixture's sources, each
        if not os.path.isdir(source.path):
            raise ConfigError(f"--data {source.path} is a text file, read as bytes (ids 0 to 255), but --init-from "
                              f"{args.init_from} reads its tokenizer's ids: make a token directory with {prepare}")
        made_by, model_tokenizer = source.tokenizer, fingerprint(args.init_from)
        if made_by and model_tokenizer and made_by[1] != model_tokenizer:
            raise ConfigError(f"--data {source.path} was tokenized by {made_by[0]}'s tokenizer.json, not by "
                              f"--init-from {args.init_from}'s: its ids mean other tokens; prepare it again with "
                              f"{prepare}")


def document_eos(args, vocab_size=None, data=None):
    """The EOS id that ends each packed document (--eos-id, else the data's meta.json's), or None where
    training sees one causal sequence: --no-document-mask, or data that declares no EOS (the synthetic
    language, bytes, nanoGPT's ids without --eos-id). --document-mask without an EOS id is an error.
    data: the data's DataInfo where it has been read (else it is read here, if --eos-id is not given)."""
    eos_id = args.eos_id if args.eos_id is not None else (data or describe_data(args)).eos_id
    if args.document_mask is False:
        return None
    if args.document_mask and eos_id is None:
        data = args.data or "the synthetic language"
        raise ConfigError(f"--document-mask needs the id that ends each document: {data} declares none; pass "
                          f"--eos-id")
    if eos_id is not None and not 0 <= eos_id < (vocab_size or eos_id + 1):
        raise ConfigError(f"--eos-id {eos_id} is not an id of the vocabulary of {vocab_size}")
    return eos_id


def check_tokens(data, rank=0, world=1):
    """Token files that are damaged, or hold ids outside the vocabulary, fail before training, on every rank:
    each rank scans its share of the token files (1/world of each: seconds even for billions of tokens),
    hashing the chunks whose SHA-256 meta.json records, and they agree on what they found."""
    found = [data.scan(rank, world)]
    if world > 1:  # (each rank's share scanned once, then every rank has every share's findings)
        found, mine = [None] * world, found[0]
        dist.all_gather_object(found, mine)
    problem = next((problem for _, problem in found if problem), None)
    if problem:
        raise ConfigError(problem)
    largest = {}
    for files, _ in found:
        for file, token_id in files.items():
            largest[file] = max(largest.get(file, token_id), token_id)
    outside = {file: token_id for file, token_id in largest.items() if token_id >= data.vocab_size}
    if outside:
        file, token_id = next(iter(outside.items()))
        raise ConfigError(f"--data {file} holds token id {token_id}, outside the vocabulary of {data.vocab_size} "
                          f"(meta.json's or meta.pkl's vocab_size, else --vocab-size, else GPT-2's)")


def check_pipeline(args, n_layer):
    if args.pp == 1:
        if args.schedule in pp.CHUNKS_A_RANK or args.virtual_stages > 1:
            raise ConfigError(f"--schedule {args.schedule} and --virtual-stages need pipeline parallelism (--pp > 1)")
        return
    if args.schedule in pp.SPLIT_BACKWARD and args.recompute != "none":
        raise ConfigError(f"--schedule {args.schedule} with --recompute is not supported: it splits every backward "
                          f"in two (B, then W later), and a recomputed block would run its forward again in each half")
    try:
        pp.make_schedule(args.schedule, args.micro_batches, args.pp, 0, args.virtual_stages)
        pp.split_layers(n_layer, args.pp * args.virtual_stages)
    except ValueError as e:
        raise ConfigError(f"--pp {args.pp} --schedule {args.schedule}: {e}") from None


def data_vocab_size(args):
    """The vocabulary of the training data, known before anything is loaded (see data.DataInfo.read)."""
    return describe_data(args).vocab_size


def synthetic_vocab_size(args):
    """The synthetic language's vocabulary: --vocab-size, else the --init-from model's, else the preset's."""
    return args.vocab_size or (hf_vocab_size(args.init_from) if args.init_from else PRESETS[args.model]["vocab_size"])


def hf_vocab_size(folder):
    try:
        return hf.language_model(hf.read_config(folder))["vocab_size"]  # (Gemma 3's multimodal: its text model's)
    except (hf.UnsupportedModel, KeyError) as e:
        raise ConfigError(f"--init-from {folder}: {e}") from None


def arch_shape(args):
    """The GPTConfig fields --arch adds to the preset's shape (a ConfigError where it has no such shape)."""
    block, shapes = ARCHS[args.arch]
    if args.model in WHOLE_MODELS and args.arch != WHOLE_MODELS[args.model][0]:
        arch, name = WHOLE_MODELS[args.model]
        raise ConfigError(f"--model {args.model} is {name}'s whole architecture: add --arch {arch}")
    if args.model in LLAMA_ONLY and args.arch == "gpt":
        raise ConfigError(f"--model {args.model} is a Llama-style shape: add --arch llama")
    if block and args.model not in shapes:
        raise ConfigError(f"--model {args.model} has no --arch {args.arch} shape (those that have one: "
                          f"{', '.join(shapes)})")
    return dict(block, **shapes.get(args.model, {}))


def expert_flags(args):
    """{GPTConfig field: value} of the mixture-of-experts flags, None where not given (the preset's stands)."""
    return dict(n_experts=args.experts, top_k=args.top_k, n_shared_experts=args.shared_experts,
                n_group=args.expert_groups, topk_group=args.group_top_k)


# The flags that shape the model over a preset: {flag: GPTConfig field}.
SHAPE_FLAGS = {"--d-model": "d_model", "--heads": "n_head", "--head-dim": "head_dim", "--d-ff": "d_ff",
               "--qk-norm": "qk_norm", "--sliding-window": "sliding_window", "--attention-sinks": "attention_sinks",
               "--window-layers": "window_layers"}


def shape_flags(args):
    """{flag: value} of the shape flags given (SHAPE_FLAGS), each a positive size (or --qk-norm)."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in SHAPE_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None and value is not False}
    for flag, value in given.items():
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    return given


def window_layers(pattern, n_layer):
    """The layers --window-layers names: indices "0,2,4", or "LOCAL:GLOBAL", from layer 0 runs of LOCAL
    windowed layers each followed by GLOBAL full ones."""
    try:
        if ":" not in pattern:
            return tuple(int(i) for i in pattern.split(","))
        local, full = (int(n) for n in pattern.split(":"))
        if local < 1 or full < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--window-layers {pattern}: give layer indices (0,2,4) or LOCAL:GLOBAL (5:1)") from None
    return tuple(i for i in range(n_layer) if i % (local + full) < local)


def model_config(args, vocab_size):
    """The model the flags describe (a ConfigError if they describe none); vocab_size: the data's."""
    shape_given = shape_flags(args)
    # Mixtures of experts: how they are balanced is a training choice, with a model from anywhere.
    moe = dict(aux_loss_coef=args.aux_loss_coef if args.balance != "bias" else 0.0, aux_loss_scope=args.aux_loss_scope,
               bias_update_rate=args.bias_update_rate if args.balance != "aux" else 0.0)
    if args.init_from and shape_given:
        raise ConfigError(f"{', '.join(shape_given)}: --init-from {args.init_from} sets the model's shape from its "
                          f"config.json (its weights have that shape)")
    if args.init_from:
        try:
            hf_config = hf.read_config(args.init_from)
            config = hf.config_from_hf(hf_config, args.seq_len, **moe)
            if args.layers and not 1 <= args.layers <= config.n_layer:
                raise ConfigError(f"--layers {args.layers}: --init-from {args.init_from} has {config.n_layer} blocks "
                                  f"(--layers keeps the first N of them)")
            # The first N blocks read as the folder's own mapping reads them (a Qwen-MoE's sparse blocks among
            # them): the config train.py saves and exports (hf.with_layers) describes the same model.
            if args.layers:
                config = hf.config_from_hf(hf.with_layers(hf_config, args.layers), args.seq_len, **moe)
            return config
        except (hf.UnsupportedModel, KeyError) as e:  # (KeyError: a config.json without a field it needs)
            raise ConfigError(f"--init-from {args.init_from}: {e}") from None
    shape = dict(PRESETS[args.model], seq_len=args.seq_len, n_layer=args.layers, vocab_size=vocab_size,
                 padded_vocab_size=pad_vocabulary(vocab_size))
    shape.update(arch_shape(args))
    if shape.get("window_layers"):  # --layers N keeps the first N blocks of the preset: its windowed ones among them
        shape["window_layers"] = tuple(i for i in shape["window_layers"] if i < shape["n_layer"])
    if args.kv_heads:
        shape.update(n_kv_heads=args.kv_heads)
    shape.update({SHAPE_FLAGS[flag]: value for flag, value in shape_given.items()})
    if args.window_layers:
        shape["window_layers"] = window_layers(args.window_layers, shape["n_layer"])
    shape.update({field: value for field, value in expert_flags(args).items() if value is not None})
    if shape.get("n_experts") and not 1 <= shape.get("top_k", 2) <= shape["n_experts"]:
        raise ConfigError(f"--top-k {shape.get('top_k', 2)} must be between 1 and --experts {shape['n_experts']}")
    if shape.get("moe_layers"):  # --layers N keeps the first N blocks of the preset: its MoE layers among them
        shape["moe_layers"] = tuple(i for i in shape["moe_layers"] if i < shape["n_layer"])
        if not shape["moe_layers"]:  # (none: every block dense, where an empty moe_layers would mean all MoE)
            shape["n_experts"] = 0
    try:
        return GPTConfig(**shape, **moe)
    except ValueError as e:
        flags = "".join(f" {flag}" if value is True else f" {flag} {value}" for flag, value in shape_given.items())
        raise ConfigError(f"--model {args.model} --arch {args.arch}{flags}: {e}") from None
