"""python -m tools.fuzz: random layouts of every flag, each against one process."""
import collections
import random
import shlex

import pytest

from tools import fuzz, parity

SEEDS = ["0", "1", "2"]  # the full tier's; CI adds one drawn from the commit (.ci/run)
DRAWS_A_SEED = 6


def flags_of(flags):
    return {flag for flag in flags if flag.startswith("--")}


def test_every_flag_of_train_py_is_drawn_or_says_why_not():
    """A new flag of train.py fails here until the generator draws it or NOT_DRAWN gives the reason."""
    drawn = collections.Counter()
    for i in range(2000):
        drawn.update(flags_of(fuzz.draw(random.Random(f"coverage:{i}"))[1]))
    every = set(fuzz.train_flags())
    assert set(fuzz.NOT_DRAWN) <= every, "NOT_DRAWN names a flag train.py no longer has"
    never = every - set(drawn) - set(fuzz.NOT_DRAWN)
    assert not never, f"train.py flags the fuzz never draws (draw them, or say why in NOT_DRAWN): {sorted(never)}"
    assert not set(drawn) & set(fuzz.NOT_DRAWN), "a flag is both drawn and said not to be"
    assert set(drawn) <= every  # (every drawn flag is train.py's)


def test_most_draws_are_layouts_train_py_accepts():
    """The generator knows the constraints (sizes that divide, flags that need one another): of 300 draws at
    most 5% are refused, and every refusal is train.py's one line."""
    refusals = [fuzz.refusal(*fuzz.draw(random.Random(f"accepted:{i}"))) for i in range(300)]
    refused = [r for r in refusals if r is not None]
    assert len(refused) <= 15, collections.Counter(refused).most_common(5)
    assert all("\n" not in r for r in refused)


def test_a_draw_is_the_same_alone_as_among_others():
    assert fuzz.draws("7", 5)[3] == fuzz.draws("7:3", 1)[0]
    assert fuzz.draws("7", 2)[1][1:] != fuzz.draws("8", 2)[1][1:]


def test_a_differing_or_failing_draw_exits_1_and_prints_its_command(monkeypatch, capsys):
    verdicts = iter([("equal", ""), ("differ", "3 of 40 tensors differ"), ("refused", "--ep 3 needs --experts"),
                     ("failed", "RuntimeError: a rank died")])
    monkeypatch.setattr(fuzz, "try_draw", lambda world, flags, timeout: next(verdicts))
    assert fuzz.main(["4", "--seed", "5"]) == 1
    out = capsys.readouterr().out.splitlines()
    world, flags = fuzz.draw(random.Random("5:1"))
    assert out[1] == f"draw 5:1: differ (0 s): {shlex.join(fuzz.command(world, flags))}"
    assert out[2] == "    3 of 40 tensors differ"
    assert out[-1].endswith("4 draws of seed 5: 1 equal, 1 refused, 1 differ, 1 failed")


def test_a_refused_draw_is_refused_before_any_process_starts():
    assert fuzz.try_draw(2, ["--model", "tiny", "--ep", "2"], 60) == (
        "refused", "--ep spreads the experts of MoE layers: it needs --experts")


@pytest.mark.full
@pytest.mark.parametrize("seed", SEEDS)
def test_the_fixed_seeds_find_every_layout_equal_to_one_process(seed, capsys):
    counts = fuzz.fuzz(DRAWS_A_SEED, seed)
    assert counts["differ"] == counts["failed"] == 0, capsys.readouterr().out
    assert counts["equal"] >= DRAWS_A_SEED - 1  # (a refusal now and then; never the whole seed)


def test_the_parity_command_refuses_a_capacity_factor_in_one_line(capsys):
    """Found by the fuzz: what a capacity drops depends on how the layout splits the tokens, and the one
    process (model.py's MoE) is dropless, so even one rank 'differed'. The comparison is undefined: refused."""
    with pytest.raises(SystemExit) as exit_:
        parity.main(["--world", "1", "--model", "tiny", "--experts", "4", "--capacity-factor", "1.25"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("python -m tools.parity: error: --capacity-factor drops the tokens")
