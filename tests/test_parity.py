"""python -m tools.parity: a layout against one process, gradient by gradient.

It passes on composed layouts, and it catches one-line bugs planted in a copy of the repository (the
dimension files are imported from the working tree, as a user's edit would be): each exits 1 and names
a parameter the bug touches as the worst. With --hf-roundtrip, the layout's checkpoint exported as a Hugging
Face folder comes back tensor for tensor on Qwen, gpt-oss, Gemma 3 and OLMo layouts (experts over ep folded over tp,
split by expert-tp, sharded by ZeRO-3, read from MXFP4; a tied output layer across stages; Gemma's and OLMo's norms),
and a converter that drops an expert or writes a tied output layer twice is named.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

import hf_models
from distributed import REPO

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

TINY = ["--model", "tiny", "--batch-size", "8", "--micro-batches", "2", "--steps", "2"]


def parity(world, *flags, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "tools.parity", "--world", str(world), *TINY, *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def worst(out):
    """The parameter the report names as the worst."""
    return re.search(r"the worst, (\S+), from step", out.stdout).group(1)


@pytest.mark.parametrize("world,flags", [
    (16, ["--tp", "2", "--sp", "--pp", "2", "--cp", "2", "--ep", "2", "--experts", "4", "--zero", "1",
          "--arch", "llama", "--layers", "4"]),
    (4, ["--zero", "3", "--tp", "2", "--arch", "llama", "--document-mask", "--eos-id", "16", "--seq-len", "32",
         "--optimizer", "muon", "--sliding-window", "5", "--window-layers", "0", "--attention-sinks", "--fp8", "rowwise"]),
], ids=["tp2-sp-pp2-cp2-ep2-zero1-llama", "zero3-tp2-documents-window-sinks-muon-fp8"])
def test_composed_layouts_are_within_tolerance_and_exit_0(world, flags):
    out = parity(world, *flags)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every tensor within rtol 1e-09" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("blocks.", "tok_emb", "lm_head"))]
    assert len(rows) > 10 and all(line.rstrip().endswith("-") for line in rows)  # none diverged
    assert "tp" in next(line for line in rows if line.startswith("blocks.0.attn.qkv.weight"))


def planted_copy(tmp_path, file, replacements):
    """A copy of the repository's code in tmp_path, with each (line, planted) of `file` replaced."""
    for name in ("train.py", "model.py", "mesh.py", "dp.py", "tp.py", "pp.py", "cp.py", "ep.py"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    for folder in ("training", "tools"):
        shutil.copytree(os.path.join(REPO, folder), tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    source = (tmp_path / file).read_text()
    for line, planted in replacements:
        assert source.count(line) == 1, f"{file} no longer holds the line the bug replaces"
        source = source.replace(line, planted)
    (tmp_path / file).write_text(source)


ROUNDTRIPS = [("qwen3", 4, ["--tp", "2", "--pp", "2"]),  # tied across stages, QK-norm, heads wider than hidden/heads
              ("qwen3_moe", 4, ["--tp", "2", "--ep", "2", "--expert-tp", "2", "--zero", "3"]),
              ("qwen2_moe", 2, ["--tp", "2", "--ep", "2"]),  # ep folded over tp; the gated shared expert
              ("gpt_oss_mxfp4", 2, ["--tp", "2", "--expert-tp", "2"]),  # MXFP4 in, its experts dequantized out
              ("gemma3_text", 2, ["--tp", "2"]),  # Gemma's four norms a block, tied; its per-kind rotary settings
              ("olmo2", 2, ["--tp", "2", "--sp"]),  # QK-norm over each whole projection, split by tp
              ("olmo3", 2, ["--pp", "2"])]  # windows on three layers of four, the full one's scaling


@pytest.mark.parametrize("arch,world,flags", ROUNDTRIPS, ids=[f"{arch}-{'-'.join(f.lstrip('-') for f in flags)}"
                                                             for arch, _, flags in ROUNDTRIPS])
def test_the_hugging_face_round_trip_of_a_layout_is_exact(tmp_path, arch, world, flags):
    hf_models.make_folder(str(tmp_path / arch), arch)
    out = parity(world, "--init-from", str(tmp_path / arch), "--seq-len", "16", "--steps", "1", "--hf-roundtrip",
                 *flags)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every tensor came back within rtol 1e-09" in out.stdout


EACH_TENSOR = "    for name, p in model.named_parameters():  # a tied output layer once, as the embedding\n"
# (what the converter does wrong: [(a line of tools/convert.py as it is, the line(s) with the bug)], the folder's
# architecture, ranks, flags, what the report must name)
CONVERSION_BUGS = {
    "an expert dropped": (
        [(EACH_TENSOR, "    for name, p in [(n, p) for n, p in model.named_parameters() if '.experts.1.' not in n]:"
                       "\n")],
        "qwen3_moe", 2, ["--ep", "2"], r"blocks\.1\.mlp\.experts\.1\.fc\.weight \(model\.layers\.1\.mlp\.experts\.1\."
                                         r"gate_proj\.weight, .*\): missing"),
    "a tied output layer written twice": (  # every name of model.py's, the output layer read as the embedding
        [(EACH_TENSOR, "    for name, p in model.named_parameters(remove_duplicate=False):\n"),
         ("    full = lru_cache(maxsize=1)(saved.full)",
          "    full = lambda name: saved.full(hf.tied_name(name, config))"),
         ('saved.tensors[name]["dtype"]', 'saved.tensors[hf.tied_name(name, config)]["dtype"]')],
        "qwen3", 2, ["--pp", "2"], r"lm_head\.weight: in the folder, but no tensor of the model is made of it"),
}


@pytest.mark.parametrize("bug", CONVERSION_BUGS)
def test_a_conversion_bug_fails_the_round_trip_naming_the_tensor(tmp_path, bug):
    replacements, arch, world, flags, named = CONVERSION_BUGS[bug]
    planted_copy(tmp_path, "tools/convert.py", replacements)
    hf_models.make_folder(str(tmp_path / arch), arch)
    out = parity(world, "--init-from", str(tmp_path / arch), "--seq-len", "16", "--steps", "1", "--hf-roundtrip",
                 *flags, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every tensor within rtol 1e-09, atol 1e-12 of one process" in out.stdout  # the training is right
    assert re.search(named, out.stdout) and "the round trip lost or changed" in out.stdout, out.stdout[-3000:]


def test_a_hugging_face_folder_shrunk_to_its_first_two_blocks(tmp_path):
    """--init-from a folder (a Mixtral: experts, grouped-query attention) with --layers 2: the layout reads the
    folder's first two blocks, as the one process does, and the rows are those of a two-block model."""
    hf_models.make_folder(str(tmp_path), "mixtral")
    out = parity(4, "--init-from", str(tmp_path), "--layers", "2", "--tp", "2", "--ep", "2", "--seq-len", "16")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    blocks = {int(m) for m in re.findall(r"^blocks\.(\d+)\.", out.stdout, re.MULTILINE)}
    assert blocks == {0, 1} and re.search(r"^blocks\.1\.mlp\.experts\.3\.", out.stdout, re.MULTILINE)


# (file, the line as it is, the line with the bug, ranks, flags, what the worst parameter's name must hold)
BUGS = {
    "sequence-parallel norm gradients not summed": (
        "tp.py", "        p.register_hook(partial(all_reduce, group=group))\n", "        pass\n",
        2, ["--tp", "2", "--sp"], "norm"),
    "an expert's gradient doubled": (
        "ep.py", "            block.mlp = layer(block.mlp, ep_group, stats_group, capacity_factor=capacity_factor, **options)\n",
        "            block.mlp = layer(block.mlp, ep_group, stats_group, capacity_factor=capacity_factor, **options)\n"
        "            [p.register_hook(lambda g: 2 * g) for p in block.mlp.experts.parameters()]\n",
        2, ["--ep", "2", "--experts", "4"], ".experts."),
    "a ring step's contribution dropped": (
        "cp.py", "                out[qi], lse[qi] = merge(out[qi], lse[qi], block_out, block_lse)\n",
        "                if step != 1: out[qi], lse[qi] = merge(out[qi], lse[qi], block_out, block_lse)\n",
        2, ["--cp", "2"], "."),
    "the first micro-batch's gradient handed back halved": (
        "pp.py", "            torch.autograd.backward(roots, grads)\n        return x.grad\n",
        "            torch.autograd.backward(roots, grads)\n        return x.grad if x.grad is None or m else x.grad / 2\n",
        2, ["--pp", "2", "--layers", "4"], "blocks.0."),
    "a ZeRO gradient shard off by one element": (
        "dp.py", "        shard.grad.copy_(self._across_replicas(shard.reduced).div_(self.divide_by))",
        "        shard.grad[1:].copy_(self._across_replicas(shard.reduced)[:-1].div_(self.divide_by))",
        2, ["--zero", "1"], "."),
    "Muon orthogonalising each rank's pieces of a matrix alone": (
        "train.py", '    group = mesh.groups["stage"] if mesh.size("stage") > 1 else None\n', "    group = None\n",
        2, ["--tp", "2", "--arch", "llama", "--optimizer", "muon"], "blocks."),
}


@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_bug_is_caught_and_the_worst_row_names_what_it_touches(tmp_path, bug):
    file, line, planted, world, flags, touched = BUGS[bug]
    planted_copy(tmp_path, file, [(line, planted)])
    out = parity(world, *flags, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "differ beyond rtol" in out.stdout and touched in worst(out), out.stdout[-3000:]
