"""tools/plan/'s prediction against what a run of train.py logged (every rank, every step)."""
import json
import os

from training import cli
from tools import plan

# Activations are modelled term by term from what model.py's operators save (plan.block_activations), and
# equal the meter's count exactly, in every dtype.
ACTIVATION_MARGIN = {"float64": 0, "float32": 0, "bfloat16": 0}
# With top-k below the number of experts, what an expert receives depends on the router: these are
# predicted for balanced routing.
ROUTED = ("comm_ep_all_to_all_bytes", "comm_tp_all_reduce_bytes", "comm_fp8_all_reduce_bytes", "activation_peak_bytes")


def here(peak, process_bytes):
    """The plan's peak on this process: its typical interpreter and PyTorch (plan.PROCESS_BYTES) replaced by the
    process's own, measured before it built anything (train.py's and the dry run's process_bytes). A resident
    set counts the shared libraries' pages as the page cache holds them (collapsed into huge pages, a library
    counts whole), so that figure is this machine's and this moment's, not the code's."""
    return peak - plan.PROCESS_BYTES + process_bytes


def logged_records(out_dir):
    (run,) = os.listdir(out_dir)
    with open(os.path.join(out_dir, run, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def imbalance(record):
    """How far the most (or least) loaded expert of any MoE layer was from the mean, relative to it."""
    worst = 0.0
    for counts in record["tokens_per_expert"]:
        mean = sum(counts) / len(counts)
        if mean:  # a layer of another pipeline stage counts nothing on rank 0's record
            worst = max(worst, max(abs(c - mean) for c in counts) / mean)
    return worst


def assert_matches_plan(out_dir, argv, world):
    """Every logged memory and traffic counter equals tools/plan/'s prediction; activations within
    ACTIVATION_MARGIN; with routing by top-k < experts, the routed counters within the step's imbalance."""
    args = cli.parse_args(argv)
    predicted = plan.predict(args, world)
    config, _ = cli.check_args(args, world)  # the model's experts: --experts, or an --init-from folder's
    routed = config.n_experts and config.top_k < config.n_experts
    for record in logged_records(out_dir):
        for field, values in predicted.items():
            if field not in record:  # recompute_bytes: the planner's own (the meter counts forwards)
                continue
            where = f"step {record['step']} {field}: logged {record[field]}, predicted {values}"
            if routed and field in ROUTED:  # a rank's routed share is off balance by about the worst expert's
                # (relative to the larger of predicted and logged: a rank's tokens are a sample of the stage's,
                # so its share may fall below balance as far as it rises above it)
                margin = imbalance(record)
                assert all(abs(p - m) <= margin * max(p, m) for p, m in zip(values, record[field])), \
                    f"{where} ({margin})"
            elif field == "comm_cp_send_recv_bytes" and cli.document_eos(args) is not None:
                # packed documents: the ring's figure is its most (a block no rank ahead needs goes no further)
                assert all(m <= p for p, m in zip(values, record[field])), where
            elif field == "activation_peak_bytes":
                margin = ACTIVATION_MARGIN[args.dtype]
                assert all(abs(p - m) <= margin * m for p, m in zip(values, record[field])), where
            else:
                assert record[field] == values, where
