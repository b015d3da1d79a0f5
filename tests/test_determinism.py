"""--deterministic (training/determinism.py): what it sets on GPUs, before NCCL and cuBLAS start, and on CPUs,
where a run repeats bit for bit already, nothing. (tests/test_cuda.py runs a GPU run twice with it.)"""
import json
import os

import torch

from oracle import EQUIVALENCE
from training import cli, determinism
import train


def test_on_gpus_the_kernels_cublas_and_nccl_are_pinned(monkeypatch):
    called = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: called.append(mode))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    for key in determinism.ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    settings = determinism.make_deterministic(cuda=True)
    assert called == [True] and torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert {key: os.environ[key] for key in determinism.ENVIRONMENT} == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert settings == dict(determinism.ENVIRONMENT, use_deterministic_algorithms=True, cudnn_deterministic=True,
                            cudnn_benchmark=False)


def test_on_cpus_it_sets_nothing_says_so_and_the_run_repeats_bit_for_bit(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        args = cli.parse_args([*EQUIVALENCE, "--deterministic", "--out", str(tmp_path), "--name", name])
        runs.append(train.train(args)["losses"])
        assert json.loads((tmp_path / name / "config.json").read_text())["deterministic"] == {}
    assert runs[0] == runs[1]
    assert "--deterministic: on CPUs a run repeats bit for bit already; nothing to set" in capsys.readouterr().out
