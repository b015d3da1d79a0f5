"""Global-batch balance (--aux-loss-scope global, Qwen's): the Switch loss with each expert's share of the previous
step's whole global batch, on one device against its definition, and under every layout equal to one device in
float64 and to the counters of tools.plan, with 1 and 4 micro-batches, recomputed or not."""
import pytest
import torch

import model
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from planned import assert_matches_plan


def test_the_loss_weighs_this_micro_batch_by_the_last_steps_shares():
    """Before any step f is uniform (the loss 1 for any routing, so no push); after a step, f is each expert's share
    of every micro-batch the step ran, whichever micro-batch is balanced now, and a forward that runs again for
    backward (recomputation) neither counts nor changes it."""
    config = model.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16, n_experts=4, top_k=2,
                             aux_loss_scope="global")
    moe = model.MoE(config).double()
    micro_batches = [torch.randn(3, 8, 16, dtype=torch.float64) for _ in range(2)]
    for x in micro_batches:
        moe(x)
        torch.testing.assert_close(moe.aux_loss, torch.tensor(1.0, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    step_load = moe.load.clone()
    assert step_load.sum() == 2 * 3 * 8 * 2  # tokens x choices, over both micro-batches
    model.end_moe_step(moe)
    assert torch.equal(moe.balance_load, step_load) and not moe.load.any()
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    moe(x)
    probs = model.route(moe.router(x.view(-1, 16)), 2)[2]
    f = step_load.double() / step_load.sum()
    expected = 4 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-14, atol=1e-15)
    counted = moe.load.clone()
    moe.recomputing = True
    moe(x)
    assert torch.equal(moe.load, counted) and torch.equal(moe.balance_load, step_load)
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-14, atol=1e-15)


def test_the_last_steps_loads_are_kept_in_the_state_dict():
    """A resumed run balances its first step by the loads of the step before it: they are saved."""
    config = model.GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, n_experts=4,
                             aux_loss_scope="global", moe_layers=(1,))
    state = model.GPT(config).state_dict()
    assert "blocks.1.mlp.balance_load" in state and "blocks.0.mlp.balance_load" not in state
    assert not any(name.endswith("balance_load")
                   for name in model.GPT(model.GPTConfig(n_experts=4)).state_dict())  # (other scopes: none)


GLOBAL = [*EQUIVALENCE, "--experts", "4", "--top-k", "2", "--aux-loss-coef", "0.1", "--aux-loss-scope", "global",
          "--steps", "3"]
FOUR = ["--micro-batches", "4", "--batch-size", "16"]

# (ranks, the experiment's flags (the oracle's too), the layout's)
LAYOUTS = [
    (4, [], ["--ep", "2", "--tp", "2", "--sp"]),  # experts folded over tp with sp
    (4, FOUR, ["--ep", "2", "--cp", "2", "--recompute", "full"]),  # ... over cp
    (2, FOUR, ["--pp", "2", "--schedule", "1f1b"]),
    (2, [*FOUR, "--layers", "4"], ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                                   "--recompute", "full"]),
    (2, [*FOUR, "--layers", "4"], ["--pp", "2", "--schedule", "zbv"]),
    (2, ["--micro-batches", "1"], ["--zero", "3", "--ep", "2"]),
    (4, FOUR, ["--dp", "2", "--ep", "2", "--zero", "3", "--recompute", "full", "--tp", "2"]),
]


def layout_id(world, model_flags, flags):
    return "-".join(f.lstrip("-") for f in flags + model_flags)


@pytest.mark.full
@pytest.mark.parametrize("world,model_flags,flags", LAYOUTS, ids=[layout_id(*layout) for layout in LAYOUTS])
def test_global_balance_trains_as_one_device_under_every_layout(tmp_path, world, model_flags, flags):
    argv = [*GLOBAL, *model_flags, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*GLOBAL, *model_flags]))
    assert_matches_plan(tmp_path, argv, world)


@pytest.mark.full
def test_the_global_shares_change_the_training():
    """Not the micro-batch's balance under another name: from the second step on (the first balanced by uniform
    shares) the losses differ from --aux-loss-scope batch's."""
    balanced_globally = oracle(GLOBAL)["losses"]
    balanced_per_micro_batch = oracle([*GLOBAL, "--aux-loss-scope", "batch"])["losses"]
    assert all(abs(a - b) > 1e-9 for a, b in zip(balanced_globally[1:], balanced_per_micro_batch[1:]))
