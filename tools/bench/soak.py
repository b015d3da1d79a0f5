"""Part 3, the soak (--soak): launches that never fail, and kills that lose nothing."""
import os
import signal
import subprocess
import threading
import time

from tools.bench.common import ENV, REPO, read_log, torchrun, torchrun_command, write_json


SELF_CHECKS = {"dp.py": 4, "tp.py": 2, "pp.py": 4, "cp.py": 4, "ep.py": 4}  # file: ranks, as in the README's reading map
SOAK_RUN = ["train.py", "--model", "tiny", "--batch-size", "8", "--micro-batches", "2", "--dtype", "float64",
            "--tp", "2", "--pp", "2", "--ep", "2", "--experts", "4", "--eval-interval", "1000"]  # 8 ranks


def soak(out, repeats=20, steps=300, kill_every=40):
    """Every dimension's self-check and a short composed train.py launch, `repeats` times each in a row,
    counting failures (a flaky teardown shows here, where one run would not); then a run of `steps`
    steps whose workers are SIGKILLed every `kill_every` logged steps, set against the same run
    uninterrupted."""
    launches = {name: (ranks, [name]) for name, ranks in SELF_CHECKS.items()}
    launches["train.py"] = (8, [*SOAK_RUN, "--steps", "3", "--out", os.path.join(out, "soak", "launches")])
    failures = {}
    for name, (ranks, argv) in launches.items():
        print(f"bench: soak, {name} on {ranks} ranks x {repeats}", flush=True)
        failures[name] = []
        for i in range(repeats):
            run = subprocess.run(torchrun_command(ranks, *argv), cwd=REPO, env=ENV, capture_output=True, text=True,
                                 timeout=600)
            if run.returncode:
                failures[name].append(dict(launch=i, returncode=run.returncode, stderr=run.stderr[-2000:]))
    result = dict(repeats=repeats, failures={name: len(f) for name, f in failures.items()}, failed=failures,
                  kills=killed_run(os.path.join(out, "soak"), steps, kill_every))
    write_json(os.path.join(out, "soak.json"), result)
    return result


def killed_run(out, steps, kill_every):
    """Train `steps` steps under torchrun --max-restarts, SIGKILLing a worker whenever `kill_every` more
    steps are logged; then the same run with no kill. Returns the restarts, the steps trained twice
    (logged, then lost with the worker: they come after the last checkpoint) and the largest difference
    of the final weights and of the losses between the two."""
    argv = [*SOAK_RUN, "--steps", str(steps), "--checkpoint-interval", "10", "--resume", "auto", "--log-interval", "1"]
    log = os.path.join(out, "killed", "soak", "log.jsonl")
    print(f"bench: soak, {steps} steps with a worker killed every {kill_every}", flush=True)
    launch = subprocess.Popen(torchrun_command(8, *argv, "--out", os.path.join(out, "killed"), "--name", "soak",
                                               max_restarts=steps // kill_every + 1),
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(launch.stdout), daemon=True)
    reader.start()
    kills = 0
    for logged in range(kill_every, steps, kill_every):
        while launch.poll() is None and not (os.path.exists(log) and len(read_log(log)) >= logged):
            time.sleep(0.05)
        if launch.poll() is not None:
            break
        os.kill(worker_pids(launch.pid)[-1], signal.SIGKILL)
        kills += 1
    launch.wait()
    reader.join()
    if launch.returncode:
        raise RuntimeError("the killed run did not finish:\n" + "".join(output[-40:]))
    torchrun(8, *argv, "--out", os.path.join(out, "uninterrupted"), "--name", "soak")
    from training import checkpoint
    final = {kind: checkpoint.Checkpoint(checkpoint.checkpoints(os.path.join(out, kind, "soak"))[0]).model_state()
             for kind in ("killed", "uninterrupted")}
    losses = {kind: [e["loss"] for e in read_log(os.path.join(out, kind, "soak", "log.jsonl"))]
              for kind in ("killed", "uninterrupted")}
    return dict(steps=steps, kills=kills, restarts=sum(line.startswith("run ") for line in output) - 1,
                steps_recomputed=sum(line.startswith("step ") for line in output) - steps,
                log_steps=[e["step"] for e in read_log(log)] == list(range(steps)),
                max_weight_difference=max((final["killed"][k] - v).abs().max().item()
                                          for k, v in final["uninterrupted"].items()),
                max_loss_difference=max(abs(a - b) for a, b in zip(losses["killed"], losses["uninterrupted"])))


def worker_pids(launcher_pid):
    """The processes whose parent is the launcher (torchrun's workers), oldest first."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return sorted(found)
