"""Peak resident memory: of start-up, of a step, of a checkpoint's save and of its load, per rank
(predict_peaks), and of a pipeline stage's busiest rank, on its host or on its GPU (stage_peaks, device_peak)."""
from collections import Counter

from model import INIT_CHUNK
from tools.plan.activations import INT64
from training.count.layout import coordinates, expert_coordinates, first_of_stage, layout_of, stage_place, stage_rank
from training.count.memory import state_memory, zero_buckets
from tools.plan.muon import MuonRank, muon_ranks
from training.count.parameters import rank_parameters
from tools.plan.prediction import predict_stage, rank_figures
from training import cli


# What a process holds before any tensor: the interpreter, PyTorch's libraries, this repository's modules, the
# process groups (measured on Linux with PyTorch 2.13's CPU build: 0.29 to 0.31 GiB; on a GPU the device's
# figure, torch.cuda.max_memory_allocated, leaves it out, and the CUDA context adds to the host's).
PROCESS_BYTES = int(0.30 * 2**30)
# Filling or reading a chunk of model.INIT_CHUNK elements holds a few arrays of 8 bytes an element at once:
# the positions, their index along each dimension, the hash's steps, the values.
CHUNK_ARRAYS = 8


def chunk_bytes(largest):
    """The working arrays of filling or reading the chunks of a tensor of `largest` elements."""
    return CHUNK_ARRAYS * min(INIT_CHUNK, largest) * INT64


def zero_working(params, group, layout, lends=False):
    """The most bytes ZeRO-2 and 3 hold during a step beyond what is logged after it (their shards), in
    full weights (weights' dtype) and full gradient buckets (reduce dtype):
    - without a pipeline, ZeRO-3's two neighbouring units gathered whole (one computing, the next
      prefetched) and, in backward, their full gradients (one filling, the one before it being
      reduce-scattered); ZeRO-2's two neighbouring buckets alike (dp.ZeRO2 waits for earlier ones before it
      reduces the next), and beside them the gradient autograd computes of the parameter being copied into
      its bucket (in the weights' dtype): about bucket_bytes each, but a vocabulary table is a bucket of its
      own, and gpt-oss-20b's (201,088 x 2,880) holds 2.2 GiB in float32, twice over;
    - under a pipeline (or combined 1F1B on a single stage: layout.scheduled), whose reduction comes once, after each chunk's last backward (dp.ZeRO2, ZeRO3):
      ZeRO-2 the stage's full gradient buckets, through the step's backwards; ZeRO-3 the stage's units
      gathered whole from their first forward to that reduction, and their full gradients besides.
    A tied output layer beside its embedding (`lends`) borrows the embedding's unit (dp.lend), which ZeRO-3
    then holds through the forward and again from the output layer's backward to the backward's end: its
    weights besides, without a pipeline (under one every unit is held anyway).
    The figure is added to the activations' peak, as if both came at once: under a pipeline the
    gradients arrive with the first backward, about when the micro-batches in flight are most."""
    if layout.zero < 2 or not params:
        return 0
    w, r = layout.weight_bytes, layout.reduce_bytes
    buckets = [b.padded for b in zero_buckets(params, group, layout)]
    if layout.scheduled:
        return sum(buckets) * (r + (w if layout.zero == 3 else 0))
    neighbours = max(a + b for a, b in zip(buckets, buckets[1:] or [0]))
    if layout.zero == 3:
        lent = sum(numel for name, numel in params if name == "tok_emb.weight") if lends else 0
        return neighbours * (w + r) + lent * w
    return neighbours * r + max(numel for _, numel in params) * w


def largest_piece(params, group, layout):
    """The most elements of one parameter a rank keeps together: a whole parameter, or under ZeRO a piece of
    one, no longer than a shard."""
    sizes = [numel for _, numel in params]
    if not sizes:
        return 0
    if not layout.zero:
        return max(sizes)
    return min(max(sizes), max(b.padded for b in zero_buckets(params, group, layout)) // group)


def norm_working(params, group, layout):
    """The gradient norm sums squares in float64, a gradient piece at a time: the largest, cast (unless it is
    float64) and squared."""
    grads = layout.master_dtype if layout.zero else layout.reduce_dtype  # ZeRO's shards, or the buckets
    return largest_piece(params, group, layout) * INT64 * (1 if grads == "float64" else 2)


def written_by(layout, where, expert):
    """Whether the rank at `where` writes the checkpoint pieces it holds (checkpoint.Saver: each piece by the
    lowest rank holding it). ZeRO's shards differ on every rank of their shard group (only the replicated
    norms and biases of tp ranks other than 0 are written by another: left out here), and under hybrid
    sharding the first copy's group writes them (dp // dp_shard == 0); without ZeRO, the first replica
    writes: of a dense piece the rank with dp and cp 0, of an expert's the first of its expert group."""
    if layout.zero:
        return where["dp"] < layout.dp_shard
    if expert:
        place = expert_coordinates(layout, where)
        return place["dp_replicate"] == place["expert_dp_shard"] == 0
    return where["dp"] == where["cp"] == 0


def predict_peaks(args, world):
    """{field: [bytes of rank 0, rank 1, ...]}: each rank's peak resident memory at start-up, during a step,
    while a checkpoint is saved and while one is loaded, and the largest of the four (peak_bytes)."""
    layout = layout_of(args, world)
    config = cli.model_config(args, cli.data_vocab_size(args))
    stages = [(predict_stage(config, layout, stage), working_sets(config, layout, stage)) for stage in range(layout.pp)]
    ranks = []
    for rank in range(world):
        where = coordinates(layout, rank)
        prediction, working = stages[where["pp"]]
        ranks.append(phase_peaks(layout, rank_figures(prediction, layout, where), working, where))
    return {field: [r[field] for r in ranks] for field in ranks[0]}


def working_sets(config, layout, stage):
    """What a rank of this pipeline stage holds beyond its state at some moment: ZeRO-2 and 3's full weights
    and gradients during a step (zero_working), the gradient norm's squares, the bytes of one optimizer
    moment of its dense and of its expert pieces, and under Muon each rank's MuonRank (its step's working
    set, and the elements for which it keeps one momentum, not two moments)."""
    dense, expert, tied = rank_parameters(config, layout, stage)
    lends = config.tie_embeddings and not tied  # (both ends on this rank: dp.gpt_lend)
    groups = {kind: (params, layout.shard_group(kind))
              for kind, params in (("dense", dense), ("expert", expert), ("tied", tied))}
    return dict(largest=max(numel for _, numel in dense + expert + tied),
                zero=sum(zero_working(p, g, layout, lends) for p, g in groups.values()),
                piece=max(largest_piece(p, g, layout) for p, g in groups.values()),
                norm=max(norm_working(p, g, layout) for p, g in groups.values()),
                moment={kind: state_memory(p, g, layout, kind == "expert", layout.replicas).optim // 2
                        for kind, (p, g) in groups.items()},
                muon=muon_ranks(config, layout, stage))


def phase_peaks(layout, figures, working, where):
    """One rank's peaks (see predict_peaks), from its figures and its stage's working sets."""
    state = figures["param_bytes"] + figures["grad_bytes"] + figures["optim_bytes"]
    muon_rank = working["muon"][stage_place(layout, where)] if working["muon"] else MuonRank(0, Counter(), 0)
    # A save copies aside the weights and both moments of the pieces the rank writes: 3 moments' bytes (under
    # Muon one fewer for the elements of its pieces of matrices).
    copied = sum(3 * moment - muon_rank.elements[kind] * layout.master_bytes
                 for kind, moment in working["moment"].items()
                 if written_by(layout, where, expert=kind == "expert") and (kind != "tied" or where["pp"] == 0))
    # At start-up ZeRO-1 and 2 copy each bucket into their flat buffer, one at a time; ZeRO-3 draws each
    # piece of its shards in float64 before keeping it in the run's dtype.
    largest, weights = working["largest"], figures["param_bytes"]
    flat = {1: min(layout.bucket_bytes, weights), 2: min(layout.bucket_bytes, weights), 3: working["piece"] * INT64}
    buckets = layout.zero or layout.dense_group > 1  # (else gradients come with the first backward)
    startup = figures["param_bytes"] + (figures["grad_bytes"] if buckets else 0) + chunk_bytes(largest) + \
        flat.get(layout.zero, 0)
    computing = figures["activation_peak_bytes"] + figures["recompute_bytes"] + working["zero"]
    # (the norm comes once backward has freed everything, and the optimizer's step after it)
    step = state + max(computing, working["norm"], muon_rank.working)
    save = state + copied
    # Loading builds the rank as start-up does, then reads its optimizer state a chunk at a time, with the
    # range of the saved piece holding the chunk: the chunk itself when the checkpoint was split alike, up
    # to tp (an expert's: expert-tp) times it when it was saved whole and is read back as a slice.
    parts = max(layout.tp, layout.expert_tp)
    load = startup + figures["optim_bytes"] + min(INIT_CHUNK, largest) * layout.master_bytes * parts
    peaks = dict(startup_peak_bytes=startup, step_peak_bytes=step, save_peak_bytes=save, load_peak_bytes=load)
    peaks = {field: PROCESS_BYTES + value for field, value in peaks.items()}
    return dict(peaks, peak_bytes=max(peaks.values()))


def busiest_of_stage(layout, stage, prediction):
    """The coordinates of the rank whose peak stands for its pipeline stage's: the first (the others differ by
    ZeRO's step counters alone), or under Muon the one whose step holds most beyond the rest (an owner of
    large matrices: the largest working set, less the moments Muon saves it)."""
    if not prediction["muon"]:
        return first_of_stage(layout, stage)
    place = max(range(layout.stage), key=lambda p: prediction["muon"][p].working
                - sum(prediction["muon"][p].elements.values()) * layout.master_bytes)
    return stage_rank(layout, stage, place)


def stage_peaks(config, layout, stage, prediction):
    """phase_peaks of a pipeline stage's busiest rank (busiest_of_stage), from the stage's prediction
    (predict_stage)."""
    where = busiest_of_stage(layout, stage, prediction)
    return phase_peaks(layout, rank_figures(prediction, layout, where), working_sets(config, layout, stage), where)


def device_peak(config, layout, stage, prediction):
    """The most a GPU of this pipeline stage holds (its busiest rank): the peak of start-up, a step or a load,
    without the interpreter and PyTorch, which stay on the host, as does a save's copy."""
    peaks = stage_peaks(config, layout, stage, prediction)
    return max(peaks[f"{phase}_peak_bytes"] for phase in ("startup", "step", "load")) - PROCESS_BYTES
