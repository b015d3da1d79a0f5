"""The single-device oracle: plain training in float64, nothing distributed (tools/parity.py's
reference_steps, which python -m tools.parity runs too).

It shares with train.py only the definition of the experiment (the flags,
the model's initial weights, the optimizer's hyper-parameters and the
learning-rate schedule) and reads the same global batches; the loop itself
is written out there, as simply as possible, so a bug in train.py cannot hide
in both.
"""
import torch

import train
from tools.parity import reference_steps
from training import cli

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
    result["state_dict"] = result.pop("trainer").state.full_state_dict()
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
    """Train on one device (tools/parity.py's reference_steps, the loop written out); returns per-step losses,
    gradient norms before clipping, final state dict. The steps in skipped_steps make no update (as train.py
    skips a step whose gradient is not finite)."""
    return reference_steps(argv, skipped_steps)


def assert_matches_oracle(result, oracle, rtol=1e-9, atol=1e-12):
    """Loss at every step and every parameter after the last step, to summation-order tolerance."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(oracle["losses"]), rtol=rtol, atol=atol)
    assert result["state_dict"].keys() == oracle["state_dict"].keys()
    for name, expected in oracle["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][name], expected, rtol=rtol, atol=atol, msg=name)
