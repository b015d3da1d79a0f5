"""The single-device oracle: plain training in float64, nothing distributed.

It shares with train.py only the definition of the experiment (the flags,
the model's initial weights, the optimizer's hyper-parameters and the
learning-rate schedule) and reads the same global batches; the loop itself
is written out here, as simply as possible, so a bug in train.py cannot hide
in both.
"""
import torch

from training import cli
from training import hf
import model as model_lib
import train

# The equivalence runs: a tiny model in float64, two micro-batches, gradient clipping at 0.05 (active at
# every step, which `oracle` checks), a few AdamW steps. Tests add flags; a repeated flag takes the last value.
EQUIVALENCE = ["--model", "tiny", "--steps", "3", "--batch-size", "8", "--micro-batches", "2", "--lr", "1e-2",
               "--warmup", "1", "--grad-clip", "0.05", "--dtype", "float64", "--eval-interval", "1000",
               "--log-interval", "1000"]
_oracles = {}


def train_worker(argv):
    """train.py's training on this rank (a function for distributed.run_on_ranks): its losses, and its final
    weights gathered to model.py's layout (state_dict)."""
    result = train.train(cli.parse_args(argv))
    result["state_dict"] = result.pop("trainer").full_state_dict()
    return result


def oracle(argv):
    """reference_run(argv), computed once per test session, with clipping checked to be active."""
    key = tuple(argv)
    if key not in _oracles:
        _oracles[key] = reference_run(argv)
        clip = cli.parse_args(argv).grad_clip
        assert min(_oracles[key]["grad_norms"]) > clip, "clipping must be active for the comparison to mean anything"
    return _oracles[key]


def reference_run(argv, skipped_steps=()):
    """Train on one device; returns per-step losses, gradient norms before clipping, final state dict.
    The steps in skipped_steps make no update (as train.py skips a step whose gradient is not finite)."""
    args = cli.parse_args([*argv, "--dtype", "float64"])
    data = train.load_training_data(args)
    config = cli.model_config(args, data.vocab_size)
    model = train.build_model(config, args.seed, torch.float64, torch.device("cpu"))
    if args.init_from:  # a Hugging Face folder's weights (read whole, as one device can)
        model.load_state_dict(hf.load_state_dict(args.init_from, config))
    optimizer = train.make_optimizer(model.parameters(), args)
    eos_id = cli.document_eos(args)  # packed documents, each ended by it (None: one sequence each)
    losses, grad_norms = [], []
    for step in range(args.steps):
        tokens = data.batch("train", step, args.batch_size, args.seq_len)
        step_loss = 0.0
        for micro in tokens.chunk(args.micro_batches):  # gradient accumulation
            loss = micro_batch_loss(model, micro[:, :-1], micro[:, 1:], eos_id, tokens) / args.micro_batches
            loss.backward()
            step_loss += loss.item()
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, args)
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
        if step not in skipped_steps:
            optimizer.step()
        optimizer.zero_grad()  # to None: a parameter without a gradient next step (an unused expert) is skipped
        model_lib.update_route_biases(model)  # MoE routing biases move towards balance (--balance bias)
        losses.append(step_loss)
    return dict(losses=losses, grad_norms=grad_norms, state_dict=model.state_dict())


def micro_batch_loss(model, inputs, targets, eos_id, batch):
    """The loss of one micro-batch, times the micro-batches: the mean over its targets, or with packed
    documents its summed loss over the targets that count, divided by those of the whole `batch` over the
    micro-batches (so the step's loss is the mean over every counted target of the batch)."""
    if eos_id is None:
        return model(inputs, targets)[1]
    counted_in_batch = (batch[:, :-1] != eos_id).sum()
    micro_batches = len(batch) // len(inputs)
    return model(inputs, model_lib.document_targets(inputs, targets, eos_id), documents=model_lib.document_ids(
        inputs, eos_id), loss_tokens=counted_in_batch / micro_batches)[1]


def assert_matches_oracle(result, oracle, rtol=1e-9, atol=1e-12):
    """Loss at every step and every parameter after the last step, to summation-order tolerance."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(oracle["losses"]), rtol=rtol, atol=atol)
    assert result["state_dict"].keys() == oracle["state_dict"].keys()
    for name, expected in oracle["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][name], expected, rtol=rtol, atol=atol, msg=name)
