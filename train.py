"""Train the GPT of model.py on any mix of parallel dimensions.

    torchrun --nproc_per_node 2 train.py                 # data parallel on 2 ranks
    python train.py --model tiny --steps 50              # one process

The order of events is the order of the article: flags -> rank grid (mesh.py)
-> full model (model.py) -> parallel dimensions applied -> training loop.
Every global batch is a pure function of (seed, step) (data.py) and is split
over data ranks and micro-batches, so every configuration trains on the same
tokens and must produce the same losses as one device.

Each run writes runs/<name>/config.json, runs/<name>/log.jsonl (one JSON
record per step) and runs/<name>/checkpoint-<step>.pt (consolidated: a plain
model.py state dict, the optimizer state by parameter name, the step; see
checkpoint.py). `--resume auto` continues from the newest good one, so the
same command line serves the first launch and every restart; SIGTERM or
SIGINT stops every rank after the same step, with a checkpoint.
"""
import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

import checkpoint
from data import load_data, split_lengths, vocab_size_of
import cp
import ep
import pp
import tp
from dp import ZERO_STAGES, DataParallel, gpt_units
from mesh import Mesh, mesh_shape
from meter import ActivationMeter, gradient_bytes, optimizer_bytes, parameter_bytes, tensor_bytes
from model import GPT, GPTConfig, apply_recomputation, update_route_biases

PRESETS = {  # model shapes; vocab_size is the synthetic language's (real data brings its own)
    "tiny": dict(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=64),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=64, vocab_size=256),
    "medium": dict(n_layer=8, n_head=8, d_model=256, seq_len=256, vocab_size=256),
    # GPU sizes: GPT-2 small (124M) and medium (350M), with GPT-2's vocabulary padded to 50304.
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50304),
    # Today's shapes, with --arch llama (their key/value heads, SwiGLU width and rotary base are below);
    # for planning them (plan.py) more than for training them here. Mixtral 8x7B is mixtral with
    # --experts 8 --top-k 2.
    "llama3-8b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=8192, vocab_size=128256),
    "llama3-70b": dict(n_layer=80, n_head=64, d_model=8192, seq_len=8192, vocab_size=128256),
    "llama3-405b": dict(n_layer=126, n_head=128, d_model=16384, seq_len=8192, vocab_size=128256),
    "mixtral": dict(n_layer=32, n_head=32, d_model=4096, seq_len=4096, vocab_size=32000),
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
LLAMA_ONLY = ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral")  # shapes that exist only as Llama blocks
PEAK_TFLOPS = {  # dense bfloat16 / float32 (no TF32) TFLOP/s of one GPU, by a part of its name; first match wins
    "H200": (989, 67), "H100 PCIe": (756, 51), "H100": (989, 67), "A100": (312, 19.5),
    "L40S": (362, 91.6), "L4": (121, 30.3), "A10G": (70, 31.2),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
COMM_KINDS = {  # the collectives each dimension issues; logged as comm_<dim>_<kind>_bytes
    "dp": ("all_reduce", "all_gather", "reduce_scatter"),
    "tp": ("all_reduce", "all_gather", "reduce_scatter"),
    "pp": ("send_recv",),
    "cp": ("send_recv",),
    "ep": ("all_to_all",),
}
COMM_FIELDS = tuple(f"comm_{dim}_{kind}_bytes" for dim, kinds in COMM_KINDS.items() for kind in kinds)
LOG_FIELDS = ("loss", "grad_norm", "stop_requested", "param_bytes", "grad_bytes", "optim_bytes",
              "activation_peak_bytes", "compute_s", "comm_wait_s", "pp_bubble", "pp_peak_in_flight") + COMM_FIELDS


REPO = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
    """A combination of flags (or data) that cannot run; raised on every rank alike, before training."""


class NonFiniteStep(ArithmeticError):
    """A step whose loss or gradient norm is not finite, beyond what --skip-nonfinite-steps allows."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=PRESETS, default="small", help="model size preset")
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt",
                   help="gpt: GPT-2's block (learned positions, LayerNorm, GELU, biases); llama: rotary positions, "
                        "grouped-query attention, RMSNorm, SwiGLU, no biases")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads of grouped-query attention (default: all heads with --arch gpt, the "
                        "preset's with --arch llama)")
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
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--skip-nonfinite-steps", type=int, default=0,
                   help="steps whose gradient norm is not finite that may be skipped (no update) before the "
                        "run stops; 0: the first one stops it")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="float64 for checks; bfloat16 = float32 weights with bf16 autocast")
    p.add_argument("--data", default=None, help="text file or directory with train.bin/val.bin "
                                                "(default: the synthetic Markov language)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary of the synthetic language (default: the preset's), or of a token directory "
                        "without meta.pkl (default: GPT-2's 50257)")
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
    p.add_argument("--bucket-mb", type=float, default=25.0, help="data-parallel gradient bucket size")
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--shared-experts", type=int, default=0,
                   help="experts' widths of an MLP every token passes through besides its top-k (DeepSeek-MoE)")
    p.add_argument("--balance", choices=("aux", "bias", "both"), default="aux",
                   help="expert balancing: the Switch auxiliary loss, DeepSeek-V3's routing bias, or both")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--bias-update-rate", type=float, default=1e-3,
                   help="step of the routing bias towards balance after every training step (--balance bias, both)")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="an expert takes at most this x its fair share of a rank's tokens (0: dropless)")
    for dim, help_ in [("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")]:
        p.add_argument(f"--{dim}", type=int, default=1, help=f"{help_}-parallel size")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--schedule", choices=sorted(pp.SCHEDULES), default="1f1b", help="pipeline schedule")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved schedule; default 2 there, else 1)")
    p.add_argument("--pp-debug", action="store_true", help="print every pipeline send and receive")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation: full (each block keeps only its input), selective (the "
                        "attention core only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block's computation (its parallel communication stays eager)")
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or PRESETS[args.model]["seq_len"]
    args.layers = args.layers or PRESETS[args.model]["n_layer"]
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.virtual_stages = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    return args


def check_args(args, world):
    """The mesh for these flags on `world` ranks, or a ConfigError saying what is wrong."""
    if args.ep > 1 and not args.experts:
        raise ConfigError("--ep spreads the experts of MoE layers: it needs --experts")
    if args.experts and args.experts % args.ep:
        raise ConfigError(f"--experts {args.experts} do not divide over --ep {args.ep} ranks")
    if args.capacity_factor < 0 or (args.capacity_factor and not args.experts):
        raise ConfigError("--capacity-factor must be positive and needs --experts")
    if not args.experts and (args.shared_experts or args.balance != "aux"):
        raise ConfigError("--shared-experts and --balance shape mixture-of-experts layers: they need --experts")
    try:
        shape = mesh_shape(world, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n_data = shape.dp * shape.ep
    for flag, value in [("--batch-size", args.batch_size), ("--micro-batches", args.micro_batches),
                        ("--steps", args.steps), ("--seq-len", args.seq_len), ("--eval-batches", args.eval_batches)]:
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if args.batch_size % (args.micro_batches * n_data):
        raise ConfigError(f"--batch-size {args.batch_size} must divide into --micro-batches {args.micro_batches} "
                          f"x {n_data} data ranks (a multiple of {args.micro_batches * n_data})")
    if args.experts and not 1 <= args.top_k <= args.experts:
        raise ConfigError(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise ConfigError(f"--cp {args.cp}: --seq-len {args.seq_len} must divide into 2 x {args.cp} chunks "
                          f"(each rank holds an early and a late chunk, for load balance)")
    if args.sp and args.tp == 1:
        raise ConfigError("--sp (sequence parallelism) splits the sequence over the tensor-parallel group: "
                          "it needs --tp > 1")
    check_pipeline(args)
    check_data(args)
    config = model_config(args, data_vocab_size(args))
    if args.tp > 1:
        problem = tp.check_tensor_parallel(args.tp, config.n_head, config.d_ff, config.vocab_size,
                                           args.seq_len // args.cp if args.sp else None, config.n_kv_heads)
        if problem:
            raise ConfigError(f"--tp {args.tp}: {problem}")
    return shape


def check_data(args):
    """--data that cannot train (missing, empty, shorter than one sequence) fails here, not mid-run."""
    if args.data is None:
        return
    try:
        lengths = split_lengths(args.data)
    except FileNotFoundError as e:
        raise ConfigError(f"--data {args.data}: no such file or directory ({e.filename})") from None
    for split, n_tokens in lengths.items():
        if n_tokens < args.seq_len + 1:
            raise ConfigError(f"--data {args.data}: the {split} split has {n_tokens} tokens, fewer than one "
                              f"sequence of --seq-len {args.seq_len} plus its last target")


def check_vocabulary(data, rank, world):
    """Token ids outside the vocabulary fail before training, on every rank: each rank scans its share of
    the token files (1/world of each split: seconds even for billions of tokens), and they agree on the largest."""
    largest = torch.tensor([data.largest_id(rank, world)], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if largest.item() >= data.vocab_size:
        raise ConfigError(f"--data {data.path} holds token id {largest.item()}, outside the vocabulary of "
                          f"{data.vocab_size} (meta.pkl's vocab_size, else --vocab-size, else GPT-2's)")


def check_pipeline(args):
    if args.pp == 1:
        if args.schedule == "interleaved" or args.virtual_stages > 1:
            raise ConfigError("--schedule interleaved and --virtual-stages need pipeline parallelism (--pp > 1)")
        return
    if args.schedule == "zb1" and args.recompute != "none":
        raise ConfigError("--schedule zb1 with --recompute is not supported: ZB-H1 splits every backward in two "
                          "(B, then W later), and a recomputed block would run its forward again in each half")
    if args.zero >= 2:
        raise ConfigError(f"--zero {args.zero} with --pp is not supported: ZeRO-2/3 reduce gradients in every "
                          f"backward, which a pipeline runs once per micro-batch and stage (M times the traffic, "
                          f"and ZeRO-3 would gather every stage's weights per micro-batch); use --zero 1")
    try:
        pp.make_schedule(args.schedule, args.micro_batches, args.pp, 0, args.virtual_stages)
        pp.split_layers(args.layers, args.pp * args.virtual_stages)
    except ValueError as e:
        raise ConfigError(f"--pp {args.pp} --schedule {args.schedule}: {e}") from None


def run_name(args, world):
    return args.name or f"gpu{world}_tp{args.tp}_pp{args.pp}_cp{args.cp}_ep{args.ep}"


def lr_at(step, args):
    """Linear warm-up to --lr, then cosine decay to --lr * --min-lr-ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - min_lr)


def init_distributed(timeout=timedelta(minutes=5)):
    """Join the launch's process group (or make a one-rank group); returns this rank's device.

    On GPUs (one per rank) the group has two backends: NCCL for CUDA tensors, the training's
    collectives, and gloo for CPU tensors, the small bookkeeping (log records, the gathers of
    checkpoints), since NCCL takes CUDA tensors only. mesh.py's groups inherit both. Binding the
    device creates NCCL's communicators now rather than at a first collective that not every rank
    of a group might join (a pipeline's first point-to-point).
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend, device_id = ("cpu:gloo,cuda:nccl", device) if cuda else ("gloo", None)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        store = launcher_store(rank, world) if "WORLD_SIZE" in os.environ else dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device_id,
                                timeout=timeout)
    return device


def launcher_store(rank, world):
    """The launch's key-value store, under a prefix of this attempt's own.

    The ranks meet there to exchange their addresses. When torchrun restarts the workers of a run that
    failed, the store is the same and still holds the dead workers' addresses: read by a new rank
    before its peer has written its own, one sends it to a closed port and the restart fails. Keys
    under the restart count's prefix are only ever this attempt's.
    """
    hosted_by_launcher = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's own
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not hosted_by_launcher)
    return dist.PrefixStore(attempt_prefix(), store)


def attempt_prefix():
    """A prefix for the keys of this attempt of the launch (torchrun counts its restarts)."""
    return f"train.py/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def data_vocab_size(args):
    """The vocabulary of the training data, known before anything is loaded (see data.vocab_size_of)."""
    synthetic = args.vocab_size or PRESETS[args.model]["vocab_size"]
    return vocab_size_of(args.data, synthetic if args.data is None else args.vocab_size)


def load_training_data(args):
    return load_data(args.data, data_vocab_size(args), seed=args.seed)


def peak_flops(args, device):
    """One device's peak FLOP/s for this run's dtype: --peak-tflops, else the table's (CUDA only), else None."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda" or args.dtype == "float64":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((peaks for part, peaks in PEAK_TFLOPS.items() if part in name), None)
    return peaks and peaks[args.dtype == "float32"] * 1e12


def padded_vocab(vocab_size):
    """The vocabulary rounded up to a multiple of 64 (as nanoGPT does), so it splits over tensor-parallel ranks."""
    return -(-vocab_size // 64) * 64


def model_config(args, vocab_size):
    """The model the flags describe (a ConfigError if they describe none)."""
    if args.model in LLAMA_ONLY and args.arch != "llama":
        raise ConfigError(f"--model {args.model} is a Llama-style shape: add --arch llama")
    shape = dict(PRESETS[args.model], seq_len=args.seq_len, n_layer=args.layers, vocab_size=padded_vocab(vocab_size))
    if args.arch == "llama":
        shape.update(LLAMA, **LLAMA_SHAPES[args.model])
    if args.kv_heads:
        shape.update(n_kv_heads=args.kv_heads)
    try:
        return GPTConfig(**shape, n_experts=args.experts, top_k=args.top_k, n_shared_experts=args.shared_experts,
                         aux_loss_coef=args.aux_loss_coef if args.balance != "bias" else 0.0,
                         bias_update_rate=args.bias_update_rate if args.balance != "aux" else 0.0)
    except ValueError as e:
        raise ConfigError(f"--model {args.model} --arch {args.arch}: {e}") from None


def build_model(config, seed, dtype, device):
    """The full model, identical on every rank (same seed)."""
    torch.manual_seed(seed)
    return GPT(config).to(device, dtype)


def make_optimizer(params, args):
    # fused: one kernel for every parameter instead of a loop of small ops per tensor; on CPU as on GPU
    # it is several times faster, which matters most when data parallelism shrinks the rest of the step.
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)


def local_micro_batches(tokens, n_micro, n_data, data_rank):
    """This rank's (inputs, targets) for each micro-batch of the global batch.

    Micro-batch m is sequences [m*B/M, (m+1)*B/M) of the global batch, exactly as
    the single device accumulates them; data rank r reads the r-th slice of it.
    """
    for micro in tokens.chunk(n_micro):
        mine = micro.chunk(n_data)[data_rank]
        yield mine[:, :-1], mine[:, 1:]


# ---------------------------------------------------------------------------
# Checkpoints: consolidated to model.py's layout, whatever the configuration.
# ---------------------------------------------------------------------------

def resume_from(args, world, report=print):
    """The checkpoint this run starts from: --resume PATH, or under --resume auto the newest good
    checkpoint of the run's folder (None: there is none yet, start afresh)."""
    if args.resume != "auto":
        return args.resume
    return checkpoint.newest_good(os.path.join(args.out, run_name(args, world)), report)


def keep_log_before(path, step):
    """Drop the records of `step` and later from a run's log: those of a run that died after its last
    checkpoint, which the resumed run writes again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] < step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def to_cpu(state):
    """A copy of a (nested) state on the CPU, safe to keep while training goes on."""
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    return state.detach().cpu().clone() if torch.is_tensor(state) else state


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------

class GradientSync:
    """Several data-parallel gradient averagers (dense and expert parameters) driven as one."""

    def __init__(self, syncs):
        self.syncs = syncs

    @contextmanager
    def _each(self, context):
        """Enter the context manager method `context` of every averager."""
        with ExitStack() as stack:
            for sync in self.syncs:
                stack.enter_context(getattr(sync, context)())
            yield

    def no_sync(self):
        return self._each("no_sync")

    def keep_incomplete_buckets(self):
        return self._each("keep_incomplete_buckets")

    def finish_grad_sync(self):
        for sync in self.syncs:
            sync.finish_grad_sync()

    @property
    def comm_bytes(self):
        return sum((sync.comm_bytes for sync in self.syncs), Counter())


class Trainer:
    """The model with its parallel dimensions applied, its optimizer, and one training step."""

    def __init__(self, args, mesh, data, device):
        self.args, self.mesh, self.data, self.device = args, mesh, data, device
        dtype = torch.float64 if args.dtype == "float64" else torch.float32
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16"
                         else nullcontext())
        # 1. The full model, identical on every rank (restored from a checkpoint when resuming).
        self.model = build_model(model_config(args, data.vocab_size), args.seed, dtype, device)
        saved = checkpoint.load(args.resume) if args.resume else None
        if saved:
            self.model.load_state_dict(saved["model"])
        self.n_params = sum(p.numel() for p in self.model.parameters())
        # 2. Expert parallelism: each rank keeps E/ep experts; tokens reach them by all-to-all. The
        #    load-balancing statistics span every rank holding different tokens (the dense group).
        self.moe_layers = []
        if args.experts:
            ep.apply_expert_parallel(self.model, mesh.groups["ep"], mesh.groups["dense"], args.capacity_factor)
            self.moe_layers = [m for m in self.model.modules() if isinstance(m, ep.ExpertParallelMoE)]
            for index, layer in enumerate(self.moe_layers):  # (a pipeline stage runs only its own)
                layer.register_forward_hook(partial(self.count_routing, index))
        # 3. Tensor parallelism: weight matrices split over the tp group (Megatron), optionally the sequence
        #    too; inside the experts just placed as well.
        self.tp_group, self.tp_size, self.tp_layouts = mesh.groups["tp"], mesh.size("tp"), {}
        if self.tp_size > 1:
            tp.apply_tensor_parallel(self.model, self.tp_group, sequence_parallel=args.sp)
            self.tp_layouts = tp.sharded_layouts(self.model)
        # 4. Context parallelism: this rank holds a zigzag shard of the sequence; attention goes round a ring.
        self.cp_size, self.positions = mesh.size("cp"), None
        if self.cp_size > 1:
            cp.apply_context_parallel(self.model, mesh.groups["cp"])
            self.positions = cp.zigzag_positions(args.seq_len, self.cp_size, mesh.index("cp"), device)
        # 5. Pipeline parallelism: this rank keeps its stage's layers (V chunks with interleaving).
        self.pp_group, self.pp_size, self.chunks = mesh.groups["pp"], mesh.size("pp"), None
        if self.pp_size > 1:
            self.chunks = pp.apply_pipeline_parallel(self.model, self.pp_group, args.virtual_stages, self.positions)
            seq = args.seq_len // self.cp_size
            seq = seq // self.tp_size if args.sp else seq  # sequence parallelism sends a shard
            micro = args.batch_size // (args.micro_batches * self.n_data())
            self.stage_shape = (micro, seq, self.model.config.d_model)
        self.params = list(self.model.parameters())
        if args.compile:
            self.compile_blocks()
        apply_recomputation(self.model, args.recompute)  # around what runs: ring attention, compiled blocks
        # 6. Data parallelism: dense gradients averaged over the dense-gradient group (ZeRO: sharded),
        #    expert gradients over the expert-gradient group (divided by the dense group's size, see ep.py).
        group, bucket_bytes = mesh.groups["dense"], int(args.bucket_mb * 2**20)
        named = list(self.model.named_parameters())
        dense = [p for name, p in named if not ep.is_expert_parameter(name)]
        experts = [p for name, p in named if ep.is_expert_parameter(name)]
        expert_group = dict(group=mesh.groups["expert"], divide_by=mesh.size("dense"))
        self.zeros = []  # ZeRO: one instance for the dense parameters, one for the experts' (DeepSeek-V3's layout)
        if args.zero:
            def shard(params, units, group, **options):
                return ZERO_STAGES[args.zero](self.model, group, lambda shards: make_optimizer(shards, args),
                            units=units, bucket_bytes=bucket_bytes, params=params, **options)
            self.zeros.append(shard(dense, gpt_units(self.model), group))
            if experts:
                self.zeros.append(shard(experts, self.moe_layers, find_unused_parameters=True, **expert_group))
            syncs, self.optimizers = self.zeros, [z.optimizer for z in self.zeros]
        else:
            syncs = []
            if mesh.size("dense") > 1:
                syncs.append(DataParallel(dense, group, bucket_bytes))
            if experts and mesh.size("dense") > 1:
                syncs.append(DataParallel(experts, bucket_bytes=bucket_bytes, find_unused_parameters=True,
                                          **expert_group))
            self.optimizers = [make_optimizer(self.params, args)]
        self.grad_sync = GradientSync(syncs) if syncs else None
        self.start_step, self.skipped_steps = 0, 0
        if saved:
            self.load_optimizer_state(saved["optimizer"])
            self.start_step, self.skipped_steps = saved["step"], saved["skipped_steps"]
        self.meter = ActivationMeter(self.params)
        self.pp_bytes_sent = 0
        self.comm_baseline = {}
        self.reset_comm_baseline()

    def compile_blocks(self):
        """torch.compile the forward of every block this rank runs, in place (parameter names unchanged).

        The compiler fuses a block's element-wise work around its matrix products. What communicates
        inside a block stays eager, as one graph break each: ring attention (point-to-point, whose shape
        of work changes block by block) and the expert-parallel MoE layer (token counts known only at
        run time). Module hooks (ZeRO-3 gathering a block's weights) stay outside the compiled forward.
        """
        for block in self.model.blocks:
            if isinstance(block, torch.nn.Identity):  # another pipeline stage's
                continue
            if isinstance(block.attn.core, cp.RingAttentionCore):
                block.attn.core = torch.compiler.disable(block.attn.core)
            if isinstance(block.mlp, ep.ExpertParallelMoE):
                block.mlp.forward = torch.compiler.disable(block.mlp.forward)
            block.forward = torch.compile(block.forward)

    # -- consolidated state: model.py's layout, whatever the configuration --------

    def unshard(self, name, tensor):
        """A tensor laid out like parameter `name`, gathered to the single device's shape (collective under tp)."""
        if name not in self.tp_layouts:
            return tensor
        dim, blocks = self.tp_layouts[name]
        return tp.unshard(tensor, dim, self.tp_group, blocks)

    def shard(self, name, full):
        """This rank's part of a full-size tensor laid out like parameter `name`."""
        if name not in self.tp_layouts:
            return full
        dim, blocks = self.tp_layouts[name]
        return tp.shard(full, dim, self.mesh.index("tp"), self.tp_size, blocks)

    def merge_stages(self, by_name):
        """{name: value} merged over pipeline stages and expert-parallel ranks, which hold different names
        (besides replicated ones, identical everywhere)."""
        for group in ("pp", "ep"):
            if self.mesh.size(group) > 1:
                everyone = [None] * self.mesh.size(group)
                dist.all_gather_object(everyone, by_name, group=self.mesh.groups[group])
                by_name = {name: value for part in everyone for name, value in part.items()}
        return by_name

    def full_state_dict(self):
        with ExitStack() as stack:
            for zero in self.zeros:
                stack.enter_context(zero.full_parameters())
            mine = to_cpu({name: self.unshard(name, t) for name, t in self.model.state_dict().items()})
        return self.merge_stages(mine)

    def full_optimizer_state(self):
        """{parameter name: AdamW state}, as one device holds it (collectives under ZeRO, tp and pp)."""
        if self.zeros:  # this rank's (tensor-sharded) parameters, by name
            local = {name: state for zero in self.zeros for name, state in zero.full_optimizer_state().items()}
        else:
            names = {p: name for name, p in self.model.named_parameters()}
            local = {names[p]: state for p, state in self.optimizers[0].state.items()}
        return self.merge_stages(to_cpu({name: {k: v if k == "step" else self.unshard(name, v)
                                                for k, v in state.items()} for name, state in local.items()}))

    def load_optimizer_state(self, by_name):
        params = dict(self.model.named_parameters())
        # The step count keeps its dtype, but goes to the parameter's device too (fused AdamW wants it there).
        local = {name: {k: v.to(params[name].device) if k == "step" else
                        self.shard(name, v).to(params[name].device, params[name].dtype)
                        for k, v in state.items()} for name, state in by_name.items() if name in params}
        for zero in self.zeros:
            zero.load_full_optimizer_state(local)
        if not self.zeros:
            for name, state in local.items():
                self.optimizers[0].state[params[name]] = state

    def checkpoint(self, step):
        """The consolidated checkpoint (every rank must call this; rank 0 writes it)."""
        return dict(model=self.full_state_dict(), optimizer=self.full_optimizer_state(), step=step,
                    skipped_steps=self.skipped_steps, args=vars(self.args))

    def n_data(self):
        return self.mesh.size("data")

    def local_micro_batches(self, tokens):
        """This rank's (inputs, targets) per micro-batch: its data slice, and its sequence shard under cp."""
        batches = local_micro_batches(tokens, self.args.micro_batches, self.n_data(), self.mesh.index("data"))
        if self.cp_size == 1:
            return list(batches)
        shard = lambda t: cp.shard_sequence(t, self.cp_size, self.mesh.index("cp"))  # noqa: E731
        return [(shard(inputs), shard(targets)) for inputs, targets in batches]

    def train_step(self, step, timeline=False):
        """One optimizer step over the global batch; returns this rank's log values."""
        args = self.args
        tokens = self.data.batch("train", step, args.batch_size, args.seq_len).to(self.device)
        self.meter.reset_peak()
        start = time.perf_counter()
        micro_batches = self.local_micro_batches(tokens)
        if not self.zeros:
            # As on one device: a parameter that gets no gradient this step on any rank (an expert no token
            # reached) has none, and AdamW leaves it alone (no weight decay, no momentum).
            self.optimizers[0].zero_grad(set_to_none=True)
        self.routing = dict(tokens_per_expert=[[0] * args.experts for _ in self.moe_layers], dropped_tokens=0)
        # Stays empty without pipeline parallelism; with `timeline`, records when each action waited and ran.
        pipeline = pp.PipelineStats(self.device, record=timeline)
        if self.chunks:
            schedules = [pp.make_schedule(args.schedule, args.micro_batches, self.pp_size, r, args.virtual_stages)
                         for r in range(self.pp_size)]
            losses, side_losses = self.run_pipeline(schedules, micro_batches, pipeline)
            # This stage's share of the step's loss: the cross-entropy (last stage) and its layers' side losses.
            contribution = (sum(losses) + sum(side_losses)) / args.micro_batches
        else:
            losses = []
            for m, (inputs, targets) in enumerate(micro_batches):
                last = m == len(micro_batches) - 1
                # Gradients are reduced once, during the last micro-batch's backward.
                with self.grad_sync.no_sync() if self.grad_sync and not last else nullcontext():
                    with self.forward_context():
                        _, loss = self.model(inputs, targets, pos=self.positions)
                    (loss / args.micro_batches).backward()  # the mean over micro-batches, as on one device
                losses.append(loss.item())
            contribution = sum(losses) / len(losses)
        grad_wait = pp.Stopwatch(self.device)  # device time, not host time (see pp.Stopwatch)
        wait_start = grad_wait.now()
        if self.grad_sync:
            self.grad_sync.finish_grad_sync()
        grad_wait.add(wait_start, grad_wait.now())
        for group in (group for optimizer in self.optimizers for group in optimizer.param_groups):
            group["lr"] = lr_at(step, args)
        # The norm is the same on every rank, so they all update, or all skip a step whose gradient is not
        # finite (the weights and AdamW's moments stay as they were; train() decides whether to go on).
        grad_norm = self.clip_gradients(args.grad_clip or math.inf).item()
        self.skipped_steps += not math.isfinite(grad_norm)
        for zero in self.zeros:
            if math.isfinite(grad_norm):
                zero.step()  # update this rank's shards, then gather the parameters
            zero.zero_grad()
        if not self.zeros and math.isfinite(grad_norm):
            self.optimizers[0].step()
        update_route_biases(self.model)  # from the step's tokens per expert, the same on every rank
        if self.moe_layers and self.pp_size > 1:  # each stage counted its own layers: the log holds them all
            self.sum_routing_over_stages()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels have run: the host clock now spans them
        elapsed = time.perf_counter() - start
        comm_wait = grad_wait.seconds() + pipeline.wait_s
        self.timeline = pipeline.timeline() if timeline else None
        return dict(self.rank_record(contribution, elapsed - comm_wait, comm_wait, pipeline), grad_norm=grad_norm)

    def count_routing(self, index, layer, inputs, output):
        """After MoE layer `index`'s forward: add its tokens per expert (summed over all ranks already) to this
        step's, if it was a training forward (not evaluation, not a recomputation for backward)."""
        if torch.is_grad_enabled() and not layer.recomputing:
            total = self.routing["tokens_per_expert"][index]
            total[:] = [a + b for a, b in zip(total, layer.tokens_per_expert)]
            self.routing["dropped_tokens"] += layer.dropped

    def sum_routing_over_stages(self):
        """Every MoE layer's tokens per expert in this step's log: each pipeline stage counted only its own
        layers (the others' lists stay zero), so one sum over the stages gives them all."""
        counts = torch.tensor([*sum(self.routing["tokens_per_expert"], []), self.routing["dropped_tokens"]],
                              dtype=torch.long, device=self.device)
        dist.all_reduce(counts, group=self.pp_group)
        *counts, dropped = counts.tolist()
        self.routing = dict(tokens_per_expert=[counts[i:i + self.args.experts]
                                               for i in range(0, len(counts), self.args.experts)],
                            dropped_tokens=dropped)

    @contextmanager
    def forward_context(self):
        """Around every forward: count the activations saved for backward; autocast to bf16 if asked."""
        with self.meter, self.autocast:
            yield

    def run_pipeline(self, schedules, micro_batches, stats=None):
        """Run a pipeline schedule on this rank's chunks: (last stage's micro-batch losses, side losses)."""
        stats = stats or pp.PipelineStats(self.device)
        losses = pp.run_schedule(schedules, self.chunks, micro_batches, self.model.loss_fn, self.pp_group,
                                 self.stage_shape, self.params[0].dtype, self.device, grad_sync=self.grad_sync,
                                 stats=stats, debug=self.args.pp_debug, forward_context=self.forward_context)
        self.pp_bytes_sent += stats.bytes_sent
        return losses

    def clip_gradients(self, max_norm):
        """Clip to the norm of the whole model's gradient, every element counted once; returns the norm.

        After synchronisation, data-parallel replicas hold identical gradients,
        so one rank of the dense group sees every element it holds. Across the
        tp, ep and pp groups ranks hold different parameters, or different
        shards of them, plus copies of the replicated ones: summing over those
        groups, with each replicated gradient weighted 1/copies, counts every
        element once.
        """
        weights = {p: 1 / self.copies(name) for name, p in self.model.named_parameters()}
        other_groups = [self.mesh.groups[g] for g in ("tp", "ep", "pp") if self.mesh.size(g) > 1]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for zero in self.zeros:  # ZeRO: the shards' squares, summed over each instance's group
            squares += zero.squared_norm(weights)
        for p in self.params if not self.zeros else ():
            if p.grad is not None:  # None: no rank used it this step
                squares += p.grad.to(torch.float64).square().sum() * weights[p]
        for group in other_groups:
            dist.all_reduce(squares, group=group)
        total_norm = squares.sqrt()
        scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for zero in self.zeros:
            zero.scale_grads(scale)
        if not self.zeros:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total_norm)
        return total_norm

    def copies(self, name):
        """How many ranks of the tp and ep groups hold a copy of parameter `name` (1: each holds its own)."""
        tp_copies = 1 if name in self.tp_layouts else self.tp_size
        ep_copies = 1 if ep.is_expert_parameter(name) else self.mesh.size("ep")
        return tp_copies * ep_copies

    def comm_counters(self):
        """Cumulative bytes sent by this rank, per (dimension, collective kind)."""
        sources = {"dp": self.grad_sync.comm_bytes if self.grad_sync else {}, "tp": tp.comm_bytes,
                   "pp": {"send_recv": self.pp_bytes_sent}, "cp": cp.comm_bytes, "ep": ep.comm_bytes}
        return {f"comm_{dim}_{kind}_bytes": sources[dim].get(kind, 0)
                for dim, kinds in COMM_KINDS.items() for kind in kinds}

    def reset_comm_baseline(self):
        """Count from here (so a step's record leaves out validation and checkpoint traffic)."""
        self.comm_baseline = self.comm_counters()

    def rank_record(self, loss, compute_s, comm_wait_s, pipeline):
        param_shards = [shard for zero in self.zeros for shard in zero.param_shards]
        grad_shards = [shard for zero in self.zeros for shard in zero.grad_shards]
        record = dict(loss=loss, param_bytes=parameter_bytes(self.params + param_shards),
                      grad_bytes=gradient_bytes(self.params) + tensor_bytes(grad_shards),
                      optim_bytes=sum(map(optimizer_bytes, self.optimizers)), activation_peak_bytes=self.meter.peak,
                      compute_s=compute_s, comm_wait_s=comm_wait_s, pp_bubble=pipeline.bubble(),
                      pp_peak_in_flight=pipeline.peak_in_flight)
        counters = self.comm_counters()  # bytes sent during this step
        record.update({field: counters[field] - self.comm_baseline[field] for field in COMM_FIELDS})
        self.comm_baseline = counters
        return record

    @torch.no_grad()
    def validation_loss(self):
        """Mean cross-entropy over --eval-batches held-out global batches (no MoE auxiliary loss)."""
        args, losses = self.args, []
        for i in range(args.eval_batches):
            tokens = self.data.batch("val", i, args.batch_size, args.seq_len).to(self.device)
            # The same micro-batches as training, so a pipeline sees the shapes it was built for.
            micro_batches = self.local_micro_batches(tokens)
            if self.chunks:
                schedules = [pp.forward_only(args.micro_batches, self.pp_size, r, args.virtual_stages)
                             for r in range(self.pp_size)]
                losses += self.run_pipeline(schedules, micro_batches)[0]
            else:
                for inputs, targets in micro_batches:
                    with self.autocast:
                        logits, _ = self.model(inputs, pos=self.positions)
                    losses.append(self.model.loss_fn(logits, targets).item())
        return mean_over_ranks(losses)


def mean_over_ranks(values):
    """The mean of every rank's values (ranks without any, like early pipeline stages, add nothing)."""
    t = torch.tensor([sum(values), len(values)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def gather_records(record):
    """Every rank's record, as {field: [value of rank 0, rank 1, ...]} (one small all-gather)."""
    mine = torch.tensor([float(record[f]) for f in LOG_FIELDS], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    as_number = lambda f, x: int(x) if f.endswith("_bytes") else x  # bytes are exact integers in float64
    return {f: [as_number(f, t[i].item()) for t in everyone] for i, f in enumerate(LOG_FIELDS)}


def train(args):
    """Run the training described by args; returns the losses and the final consolidated state dict."""
    device = init_distributed(timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = check_args(args, world)
    args.resume = resume_from(args, world, report=print if rank == 0 else lambda message: None)
    mesh = Mesh(shape, timeout=timedelta(seconds=args.timeout))
    data = load_training_data(args)
    check_vocabulary(data, rank, world)
    trainer = Trainer(args, mesh, data, device)
    run_dir = os.path.join(args.out, run_name(args, world))
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dict(args=vars(args), mesh=asdict(shape), model=asdict(trainer.model.config),
                           world=world, device=str(device), peak_flops=peak_flops(args, device),
                           entropy_floor=data.entropy_rate), f, indent=2)
        floor = f"{data.entropy_rate:.4f} nats/token" if data.entropy_rate else "unknown (real data)"
        print(f"run {run_dir}: {world} ranks {shape}, {trainer.n_params:,} parameters, "
              f"loss floor (entropy rate) {floor}", flush=True)
    log = None
    if rank == 0:  # one record per step: a resumed run rewrites those after its checkpoint
        keep_log_before(os.path.join(run_dir, "log.jsonl"), trainer.start_step if args.resume else 0)
        log = open(os.path.join(run_dir, "log.jsonl"), "a")
    losses, grad_norms, val_losses, wall = [], [], {}, 0.0
    # Model FLOPs utilisation: the FLOPs the model needs per token (recomputation not counted) times
    # tokens per second, over every device's peak.
    peak, flops_per_token = peak_flops(args, device), trainer.model.config.flops_per_token()
    end, stopped = min(args.steps, args.stop_at or args.steps), False
    last_checkpoint = args.resume  # the newest good one: where a run stopped by bad numbers can go back to
    with Preemption() as preemption:
        for step in range(trainer.start_step, end):
            # The pipeline's timeline, of one step: the last.
            timeline = args.pp > 1 and step == end - 1
            record = gather_records(dict(trainer.train_step(step, timeline), stop_requested=preemption.requested))
            if any(record.pop("stop_requested")):  # every rank learns it at the same step: all stop together
                end, stopped = step + 1, True
            entry = log_entry(args, step, record, wall, trainer)
            if timeline:  # per rank: [kind, chunk, micro-batch, waiting from, computing from, until] (seconds)
                entry["pp_timeline"] = [None] * world
                dist.all_gather_object(entry["pp_timeline"], trainer.timeline)
            if peak:
                entry["mfu"] = flops_per_token * entry["tokens_per_s"] / (world * peak)
            wall, last = entry["time_s"], step == end - 1
            losses.append(entry["loss"])
            grad_norms.append(entry["grad_norm"])
            problem = nonfinite_problem(step, record, trainer.skipped_steps, args)
            if (step + 1) % args.eval_interval == 0 or last:
                entry["val_loss"] = val_losses[step] = trainer.validation_loss()
            if rank == 0:  # logged before the checkpoint, so every step a checkpoint has passed is in the log
                log.write(json.dumps(entry) + "\n")
                log.flush()
                if step % args.log_interval == 0 or last or "val_loss" in entry:
                    print_progress(entry, args)
            if problem:  # every rank has the same record, so every rank stops here
                raise NonFiniteStep(f"{problem}; the last good checkpoint is {last_checkpoint or 'none'}")
            if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0 or last:
                state = trainer.checkpoint(step + 1)
                last_checkpoint = checkpoint.path_for(run_dir, step + 1)
                if rank == 0:
                    checkpoint.save(run_dir, step + 1, state, args.keep_checkpoints)
                    if stopped:
                        print(f"stopped after step {step} on a signal; checkpoint {last_checkpoint}", flush=True)
            trainer.reset_comm_baseline()
            if stopped:
                break
    if log:
        log.close()
    return dict(losses=losses, grad_norms=grad_norms, val_losses=val_losses, state_dict=trainer.full_state_dict(),
                entropy_floor=data.entropy_rate)


def nonfinite_problem(step, record, skipped_steps, args):
    """What is wrong with a step whose loss or gradient norm is not finite, unless it may be skipped
    (--skip-nonfinite-steps: its update was not made, see Trainer.train_step); None for a good step."""
    bad_ranks = [r for r, loss in enumerate(record["loss"]) if not math.isfinite(loss)]
    grad_norm = record["grad_norm"][0]  # the same on every rank
    if not bad_ranks and math.isfinite(grad_norm):
        return None
    if not math.isfinite(grad_norm) and skipped_steps <= args.skip_nonfinite_steps:
        return None
    losses = (f"a non-finite loss on rank{'s' * (len(bad_ranks) > 1)} {', '.join(map(str, bad_ranks))}"
              if bad_ranks else "every loss finite")
    return (f"step {step}: {losses}, gradient norm {grad_norm} (non-finite steps so far: {skipped_steps}; "
            f"--skip-nonfinite-steps {args.skip_nonfinite_steps})")


def log_entry(args, step, record, wall, trainer):
    """The log record of a step, from every rank's values (lists indexed by rank)."""
    world = len(record["loss"])
    step_s = max(c + w for c, w in zip(record["compute_s"], record["comm_wait_s"]))
    # Each rank reported its stage's share of its data's loss: the mean over ranks, times the stages.
    loss = args.pp * sum(record["loss"]) / world
    entry = dict(step=step, loss=loss, lr=lr_at(step, args), grad_norm=record["grad_norm"][0],
                 skipped_steps=trainer.skipped_steps, step_s=step_s, time_s=wall + step_s,
                 tokens_per_s=args.batch_size * args.seq_len / step_s,
                 **{k: v for k, v in record.items() if k not in ("loss", "grad_norm")})
    if args.experts:  # tokens routed to each expert of each MoE layer, and those dropped (capacity factor)
        entry.update(trainer.routing)
    if args.pp > 1:  # the measured idle fraction of each stage (pp_bubble) beside the ideal one
        entry["pp_bubble_formula"] = pp.bubble_formula(args.pp, args.micro_batches, args.virtual_stages, args.schedule)
    return entry


def print_progress(entry, args):
    val = f"  val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
    mfu = f"  MFU {entry['mfu']:.1%}" if "mfu" in entry else ""
    bubble = (f"  bubble {max(entry['pp_bubble']):.2f} (ideal {entry['pp_bubble_formula']:.2f})"
              if args.pp > 1 else "")
    print(f"step {entry['step']:5d}  loss {entry['loss']:.4f}{val}  {entry['tokens_per_s']:,.0f} tok/s{mfu}{bubble}",
          flush=True)


class Preemption:
    """SIGTERM or SIGINT (a scheduler's notice, or torchrun passing on its own) asks the run to stop after
    the step in progress, with a checkpoint; a second one ends the process at once (its default)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            self.previous = {s: signal.signal(s, self._request) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _request(self, signum, frame):
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)


def exit_with_error(message, rank, world, status):
    """Say on this rank why the run cannot go on, and exit with `status`.

    Every rank reaches the same verdict (before any communication, from the
    flags; or from a record all ranks share). torchrun stops all ranks as
    soon as one exits, so before exiting each rank counts itself in the
    launcher's key-value store and waits (30 s at most) until every rank has
    printed its message.
    """
    sys.stderr.write(f"[rank {rank}] train.py: error: {message}\n")  # one write: lines of ranks never interleave
    sys.stderr.flush()
    if world > 1 and "MASTER_ADDR" in os.environ:
        store = dist.PrefixStore(attempt_prefix(), dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)))
        store.add("exited", 1)
        deadline = time.monotonic() + 30
        while store.add("exited", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # before any process group exists: a bad launch cannot hang
        check_args(args, world)
        if args.resume not in (None, "auto"):
            checkpoint.verified_bytes(args.resume)
    except (ConfigError, checkpoint.BadCheckpoint) as e:
        exit_with_error(str(e), rank, world, status=2)
    try:
        train(args)
    except ConfigError as e:  # the data, found bad by every rank together before training
        exit_with_error(str(e), rank, world, status=2)
    except NonFiniteStep as e:
        exit_with_error(str(e), rank, world, status=1)
    except RuntimeError as e:  # in a collective, a peer died or stalled: say where this rank waited, then fail
        if not in_collective(e):
            raise
        sys.stderr.write(f"[rank {rank}] train.py: error: a collective failed while waiting in {where(e)}, "
                         f"{str(e).splitlines()[0]} (a rank that died or stalled; --timeout {args.timeout:g} s)\n")
        raise
    dist.destroy_process_group()


def in_collective(error):
    """Whether the communication backend raised this (gloo's and NCCL's errors name themselves)."""
    return isinstance(error, dist.DistError) or any(backend in str(error) for backend in ("gloo", "NCCL"))


def where(error):
    """The innermost frame of this repository's code in the error's traceback: 'file:line in function'."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.dirname(f.filename) == REPO]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


if __name__ == "__main__":
    main()
