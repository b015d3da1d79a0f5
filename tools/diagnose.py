"""What went wrong in a run, from its folder: the first collective the ranks disagree on, and the straggler.

    python -m tools.diagnose runs/gpu4_tp2_pp1_cp1_ep1

A run that fails, times out or is stopped leaves each rank's record of its last collectives in
`collectives/rank<r>.json` (training/flight.py). They are lined up here channel by channel: a group's
collectives by their number in the group (every member's n-th collective on it must be the same call),
and point-to-point messages by their number between a sender and a receiver. The first place where the
ranks part (a member issued another operation, other shapes, or the call from another place in the
code; or never got there) is the verdict: the group and its ranks, the number, the operation and
shapes, which ranks reached it and which did not, and what those were doing last. A rank that wrote no
record froze or was killed before it could (a stopped process, a lost node): its silence is the verdict.
Who is "out of step" is decided by the majority of the ranks that run the same code: the group's own
members and the members of its sibling groups (the same kind of group in the same pipeline stage).

The run's log (log.jsonl) names the straggler, if there was one: the rank the others of its pipeline stage
waited for in half the steps or more (training/stragglers.py).
"""
import argparse
import collections
import glob
import json
import os
import sys

from mesh import GROUPS, MeshShape, coordinates, group_ranks
from training import stragglers

PROG = "python -m tools.diagnose"


class DiagnoseError(Exception):
    """A folder that is not a run's: printed as one line, exit status 2."""


def read_run(folder):
    """(config.json, {rank: record}, log records) of a run folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise DiagnoseError(f"{folder}: no config.json (not a run folder of train.py's)")
    with open(path) as f:
        config = json.load(f)
    records = {}
    for file in glob.glob(os.path.join(folder, "collectives", "rank*.json")):
        with open(file) as f:
            record = json.load(f)
        records[record["rank"]] = record
    log = []
    if os.path.isfile(os.path.join(folder, "log.jsonl")):
        with open(os.path.join(folder, "log.jsonl")) as f:
            log = [json.loads(line) for line in f if line.strip()]
    return config, records, log


def group_names(shape, world):
    """{ranks: name} of the run's groups: mesh.py's (tp, cp, pp, dp, ...), and the world's."""
    names = {tuple(range(world)): "world"}
    for name, dims in reversed(GROUPS.items()):  # the first name wins: tp before stage, dp before dense
        try:
            for ranks in group_ranks(shape, dims):
                names[tuple(ranks)] = name
        except (KeyError, ValueError):
            continue
    return names


def program(record, names):
    """{step: [entry]} of the collectives a rank's main thread issued, in order (the checkpoint saver's
    thread keeps its own order, which no peer's matches)."""
    steps = collections.defaultdict(list)
    for entry in record["entries"]:
        if entry.get("thread", "MainThread") == "MainThread":
            entry["kind"] = names.get(tuple(entry["group"]), "group")
            steps[-1 if entry["step"] is None else entry["step"]].append(entry)
    return steps


def signature(entry):
    """What ranks running the same code issue alike: the operation, the kind of group, the call site and
    the shapes (left out of the experts' all-to-alls, whose rows follow the routing)."""
    shapes = "" if entry["op"] == "all_to_all_single" else json.dumps(entry["shapes"])
    return entry["op"], entry["kind"], shapes, tuple(entry["site"])


def first_step(record, steps):
    """The first step a record holds whole: a ring buffer that wrapped lost the start of its first step."""
    return min(steps) + (1 if record.get("wrapped") else 0) if steps else None


def departures(records, names, stage_of):
    """[(step, index, majority entry by rank, departing ranks)]: for each pipeline stage (whose ranks run the
    same code), the first place in program order where a rank's collective is not the one most of them
    issued there, or where it issued none."""
    programs = {rank: program(record, names) for rank, record in records.items()}
    found = []
    for stage in sorted(set(stage_of[r] for r in records)):
        ranks = [r for r in records if stage_of[r] == stage]
        starts = [first_step(records[r], programs[r]) for r in ranks]
        if None not in starts:
            found += first_departure({r: programs[r] for r in ranks}, max(starts))
    return sorted(found, key=lambda d: (d[0], d[1]))


def first_departure(programs, start):
    """[(step, index, majority entry by rank, departing ranks)] of the first place, from step `start` on,
    where the ranks' programs ({rank: {step: [entry]}}) part; [] where they never do."""
    for step in sorted(s for s in set().union(*programs.values()) if s >= start):
        lists = {r: program.get(step, []) for r, program in programs.items()}
        for index in range(max(len(entries) for entries in lists.values())):
            at = {r: entries[index] if index < len(entries) else None for r, entries in lists.items()}
            calls = {r: signature(e) if e else None for r, e in at.items()}
            ranked = collections.Counter(calls.values()).most_common(2)
            if len(ranked) == 1:
                continue
            expected = ranked[0][0] if ranked[0][1] > ranked[1][1] else None  # a tie: none is the majority
            departed = [r for r, call in calls.items() if expected is None or call != expected]
            return [(step, index, {r: e for r, e in at.items() if e and calls[r] == expected}, departed)]
    return []


def describe(entry, names):
    shapes = ", ".join(f"{dtype}{shape}" for shape, dtype in entry["shapes"]) or "no tensor"
    where = f" from {entry['site'][0]}" if entry["site"] else ""
    callers = f" < {' < '.join(s.split()[0] for s in entry['site'][1:4])}" if len(entry["site"]) > 1 else ""
    group = names.get(tuple(entry["group"]), "group")
    peer = f" with rank {entry['peer']}" if "peer" in entry else ""
    state = "returned" if entry["returned"] else "never returned"
    return (f"{entry['op']} #{entry['seq']} of {group} {entry['group']}{peer} ({shapes}){where}{callers}, "
            f"step {entry['step']}, {state}")


def verdict(config, records, world):
    """The lines naming the first collective the ranks disagree on (or saying they agree)."""
    shape = MeshShape(**config["mesh"])
    names = group_names(shape, world)
    stage_of = [coordinates(shape, r)["pp"] for r in range(world)]
    silent = [r for r in range(world) if r not in records]
    lines = [f"records from {len(records)} of {world} ranks" +
             (f"; none from rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}: frozen or killed before "
              f"it could write (a stopped process, a lost node): that silence is the verdict" if silent else "")]
    if not records:
        return lines
    for rank in sorted(records):  # the ranks left waiting for a silent one
        last = records[rank]["entries"][-1] if records[rank]["entries"] else None
        if last and (last.get("peer") in silent or set(last["group"]) & set(silent) and "peer" not in last):
            lines.append(f"  rank {rank} was left waiting for it: last in {describe(last, names)}" +
                         (f"; failed: {records[rank]['error']}" if records[rank].get("error") else ""))
    parted = departures(records, names, stage_of)
    if not parted:
        lines.append("the ranks that wrote a record issued the same collectives, in the same order")
        return lines
    step, index, expected, departed = min(parted, key=lambda d: (d[0], d[1]))
    if expected:  # the collective the departing ranks did not make, as their own group's members made it
        partners = [e for e in expected.values() if any(r in e["group"] for r in departed)]
        example = (partners or list(expected.values()))[0]
        lines.append(f"first disagreement: {example['kind']} group {example['group']}, collective #{example['seq']}, "
                     f"step {step}")
        reached = sorted(r for r, e in expected.items() if e["group"] == example["group"]) or sorted(expected)
        lines.append(f"  reached by rank{'s' * (len(reached) > 1)} {', '.join(map(str, reached))}: "
                     f"{describe(example, names)}")
    else:
        lines.append(f"first disagreement: step {step}, collective {index + 1} of the step: the ranks running the "
                     f"same code issued different ones there, none the majority's")
    for rank in sorted(departed):
        mine = program(records[rank], names).get(step, [])
        lines.append(f"  rank {rank}{' did not arrive' if expected else ''}: " +
                     (f"its call there is {describe(mine[index], names)}" if index < len(mine)
                      else "it issued nothing more"))
    for rank in sorted(departed):
        entries = records[rank]["entries"]
        if entries:
            lines.append(f"  rank {rank}'s last collective: {describe(entries[-1], names)}")
        if records[rank].get("error"):
            lines.append(f"  rank {rank} failed: {records[rank]['error']}")
    return lines


def diagnose(folder):
    """The report on a run folder, as lines."""
    config, records, log = read_run(folder)
    world = config["world"]
    lines = [f"{PROG} {folder}: {world} ranks, mesh {config['mesh']}"]
    if records:
        lines += verdict(config, records, world)
    else:
        lines.append("no record of collectives (the run did not fail, or ran with --record-collectives 0)")
    lines.append(stragglers.report([e["stragglers"] for e in log if "stragglers" in e]) or stragglers.NONE)
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("run", metavar="RUN_FOLDER", help="a run's folder (runs/NAME)")
    args = p.parse_args(argv)
    try:
        print("\n".join(diagnose(args.run)))
    except DiagnoseError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
