"""What every part of the benchmark shares: the settings (FULL, QUICK), train.py and the workers launched
under torchrun, the logs and results read and written, paired ratios over rounds, a process's resident memory."""
import ctypes
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the top folder: train.py's

FULL = dict(model="small", batch_size=64, micro_batches=2, steps=50, eval_interval=25, skip=5, rounds=36, k=1,
            scaling_rounds=3, scaling_steps=25, attention_lengths=[2048, 4096, 8192, 16384],
            document_lengths=["short", "half", "long"],
            long_sequences=dict(model="small", arch="llama", steps=6, skip=2, rounds=3, rows=[
                dict(seq_len=8192, batch_size=1, documents=256), dict(seq_len=8192, batch_size=1, documents=1024),
                dict(seq_len=8192, batch_size=1, window=256), dict(seq_len=2048, batch_size=2, documents=256)]),
            zero_pipeline=dict(batch_size=64, micro_batches=8, steps=6, rounds=15),
            muon=dict(batch_size=32, micro_batches=1, rounds=12, k=3),
            muon_convergence=dict(model="small", batch_size=32, steps=300, eval_interval=50,
                                  lrs=dict(adamw=[1e-3, 3e-3, 1e-2, 3e-2], muon=[1e-3, 3e-3, 1e-2, 3e-2])),
            fp8=dict(model="small", batch_size=16, steps=400, lr=3e-3, eval_interval=100, final_steps=50),
            fp8_cuda=dict(batch_size=8, steps=30, skip=10, rounds=3),
            moe_overlap=dict(batch_size=32, steps=8, rounds=5))
QUICK = dict(model="tiny", batch_size=16, micro_batches=2, steps=12, eval_interval=6, skip=3, rounds=6, k=1,
             scaling_rounds=1, scaling_steps=8, attention_lengths=[256, 512], document_lengths=["short", "long"],
             long_sequences=dict(model="tiny", arch="llama", steps=4, skip=1, rounds=1, rows=[
                 dict(seq_len=1024, batch_size=1, documents=64), dict(seq_len=1024, batch_size=1, window=64)]),
             zero_pipeline=dict(batch_size=16, micro_batches=4, steps=5, rounds=3),
             muon=dict(batch_size=8, micro_batches=1, rounds=2, k=1),
             muon_convergence=dict(model="tiny", batch_size=8, steps=20, eval_interval=10,
                                   lrs=dict(adamw=[3e-3, 1e-2], muon=[3e-3, 1e-2])),
             fp8=dict(model="tiny", batch_size=8, steps=12, lr=1e-2, eval_interval=6, final_steps=4),
             fp8_cuda=dict(batch_size=2, steps=6, skip=2, rounds=1),
             moe_overlap=dict(batch_size=8, steps=3, rounds=1))


def torchrun_command(n_ranks, *argv, max_restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", str(max_restarts),
            "--nproc_per_node", str(n_ranks), *argv]


ENV = dict(os.environ, OMP_NUM_THREADS="1")  # one thread a rank: ranks share the cores


def torchrun(n_ranks, *argv, timeout=1800, env=ENV):
    cmd = torchrun_command(n_ranks, *argv)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def worker_result(stdout):
    """What a launch of python -m tools.bench --worker NAME returned: the JSON its rank 0 printed after "RESULT "
    (command.run_worker)."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


def tokens_per_s(records):
    """Tokens per second over these steps of a log (the steady ones: start-up left out)."""
    return sum(e["tokens_per_s"] * e["step_s"] for e in records) / sum(e["step_s"] for e in records)


def read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def paired_ratio(times, ours="ours", theirs="builtin"):
    """The median of the rounds' paired ratios of step time, and their range."""
    ratios = [a / b for a, b in zip(times[ours], times[theirs])]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def status_kib(field):
    """A field of this process's /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak():
    """The peak resident set starts again from the current one (Linux), once glibc has given back the freed
    memory it keeps for reuse (malloc_trim), so that one phase's leftovers do not count in the next's."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
