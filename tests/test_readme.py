"""Every command line of the README and of docs/ runs, and every file, name, page and section they point to exists.

The pages are README.md and every docs/*.md (found when the tests are collected, so a page added later is
covered too). The command lines are those of a page's ```bash blocks and of its inline code that starts with
`python`, `python3` or `torchrun` (a line ending in a backslash joined to the next, `# comments` dropped,
`a && b` taken apart; pip, huggingface-cli and the like are not this repository's and are left alone).
Nothing is run for real, so the whole file takes seconds:

- `python train.py ARGS`, `torchrun [launcher flags] train.py ARGS`: ARGS go through train.py's own
  parser (training/cli.py's parse_args), which exits on an unknown flag or a bad value;
- `python -m tools.NAME [SUBCOMMAND] ARGS` and `python plot.py ARGS`: the command's --help runs (once per
  command, for every page at once), and names every flag the line uses (an unknown flag would only fail
  at run time); tools.plan and tools.dryrun hand the flags they do not know to train.py's parser, so there
  a flag of train.py's is accepted too, and the line's train.py flags and values go through that parser;
  `--only`'s names are tools/bench/'s;
- torchrun's own flags are torchrun's (its --help);
- `torchrun ... dp.py` (and tp, pp, cp, ep): the self-check's file exists and has a self-check (the
  self-checks themselves run in tests/test_copy.py and in each dimension's tests: test_dp.py, ...);
- `python -m pytest ...`: the test files it names exist, and each word of a `-k` expression is found
  in the tests.

Besides the commands: every file a page names (name.py at the top level, dir/name.py, results/name.ext)
exists; inline code such as `dp.Shard` names what that module defines (and a moved module by its package,
`training.hf`); every link finds its file, and its section where it names one. The README is the front
door: at most FRONT_DOOR_LINES lines, with the install and the test command that .ci/run runs, a link to
every page of docs/, and the reading map: a row for each section of the article "5D Parallelism from
Scratch", each name in it importable, each self-check the one its file's docstring states.
"""
import contextlib
import functools
import glob
import importlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

import torch

import train
from distributed import REPO
from model import GPT
from training import cli

README = "README.md"
PAGES = [README] + sorted(os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md")))
TEXTS = {}
for _page in PAGES:
    with open(os.path.join(REPO, _page)) as _f:
        TEXTS[_page] = _f.read()

FRONT_DOOR_LINES = 250
PYTHONS = ("python", "python3")
SELF_CHECKS = ("dp.py", "tp.py", "pp.py", "cp.py", "ep.py")
# every command in tools/: a module, or a package python -m runs (tools/plan/, with its __main__.py)
TOOLS = tuple(sorted(name.removesuffix(".py") for name in os.listdir(os.path.join(REPO, "tools"))
                     if (name.endswith(".py") and name != "__init__.py")
                     or os.path.isfile(os.path.join(REPO, "tools", name, "__main__.py"))))
FORWARDS_TO_TRAIN = ("tools.plan", "tools.dryrun", "tools.parity")  # parse_known_args: the rest is train.py's
STDLIB_MODULES = ("venv",)  # `python3 -m venv .venv` of the install line: Python's, not this repository's
HELP_TIMEOUT = 120

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[^\n]*$", re.S | re.M)


def line_of(offset, text):
    return text.count("\n", 0, offset) + 1


def without_fences(text):
    """The text with every fenced block blanked out (its line count kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def split_commands(line):
    """A shell line as token lists, one per command of `a && b; c`, comments dropped."""
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for token in tokens:
        if token in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def bash_lines(page):
    """[(line number, line)] of a page's ```bash blocks, a line ending in a backslash joined to the next."""
    text, found = TEXTS[page], []
    for m in FENCE.finditer(text):
        if m.group(1) != "bash":
            continue
        first = line_of(m.start(2), text)
        pending, pending_line = "", None
        for i, raw in enumerate(m.group(2).split("\n")):
            if pending_line is None:
                pending_line = first + i
            stripped = raw.rstrip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            found.append((pending_line, pending + raw))
            pending, pending_line = "", None
    return found


def page_commands(page):
    """[(where, tokens)] of every python/python3/torchrun command line of a page."""
    found = [(f"{page}:{number}", tokens) for number, line in bash_lines(page) for tokens in split_commands(line)]
    prose = without_fences(TEXTS[page])
    for m in re.finditer(r"`([^`]+)`", prose):
        code = " ".join(m.group(1).split())  # inline code may wrap across lines
        for tokens in split_commands(code):
            found.append((f"{page}:{line_of(m.start(), prose)} (inline)", tokens))
    return [(where, tokens) for where, tokens in found if tokens[0] in PYTHONS + ("torchrun",)]


COMMANDS = [command for page in PAGES for command in page_commands(page)]


def flags_of(tokens):
    """The option names a command line uses: --name (before any =) and -x."""
    return [t.split("=", 1)[0] for t in tokens if re.match(r"^--?[A-Za-z]", t)]


def flags_in_help(text):
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


def help_command(key):
    """The argv that prints the --help of key: ('module', name, *subcommand), ('script', file) or ('torchrun',)."""
    if key[0] == "module":
        return [sys.executable, "-m", key[1], *key[2:], "--help"]
    if key[0] == "script":
        return [sys.executable, key[1], "--help"]
    return [sys.executable, "-m", "torch.distributed.run", "--help"]  # what the torchrun command runs


def help_key(where, tokens):
    """Which --help a command line's flags are checked against (None: none)."""
    if tokens[0] == "torchrun":
        return None
    if tokens[1:2] == ["-m"] and tokens[2].startswith("tools.") and tokens[2] != "tools.NAME":
        sub = tuple(tokens[3:4]) if tokens[2] == "tools.convert" and tokens[3:4] and \
            not tokens[3].startswith("-") else ()
        return ("module", tokens[2], *sub)
    if tokens[1:2] == ["plot.py"]:
        return ("script", "plot.py")
    return None


@pytest.fixture(scope="module")
def helps():
    """{key: CompletedProcess-like (returncode, stdout, stderr)} of every --help the pages need, all run at once."""
    keys = {help_key(where, tokens) for where, tokens in COMMANDS} | {("torchrun",)}
    keys.discard(None)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    running = {key: subprocess.Popen(help_command(key), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env) for key in sorted(keys)}
    done = {}
    for key, proc in running.items():
        try:
            out, err = proc.communicate(timeout=HELP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(--help did not finish in {HELP_TIMEOUT} s)"
        done[key] = (proc.returncode, out, err)
    return done


@functools.cache
def train_help():
    """train.py's --help (its parser is training/cli.py's parse_args; printed here, in this process)."""
    from training import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    return out.getvalue()


def parse_train_args(where, args):
    """train.py's parser on args, as train.py would parse them; a failure names the page's line."""
    from training import cli
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.parse_args(list(args))
        return
    except SystemExit:
        pass
    why = (err.getvalue().strip().splitlines() or ["(no message)"])[-1]  # "train.py: error: ..."
    pytest.fail(f"{where}: train.py's parser refuses {shlex.join(args)!r}: {why}")


def check_torchrun_flags(where, launcher, helps):
    returncode, out, err = helps[("torchrun",)]
    assert returncode == 0, f"torchrun --help failed:\n{err[-3000:]}"
    unknown = [f for f in flags_of(launcher) if f not in flags_in_help(out)]
    assert not unknown, f"{where}: torchrun does not know {unknown}"


def check_tool(where, tokens, helps):
    module, key = tokens[2], help_key(where, tokens)
    assert module in {f"tools.{name}" for name in TOOLS}, f"{where}: no such tool {module} (tools/: {TOOLS})"
    args = tokens[3 + len(key) - 2:]
    if module == "tools.convert":
        assert len(key) == 3, f"{where}: python -m tools.convert needs a subcommand (to-file, from-file, to-hf)"
    returncode, out, err = helps[key]
    assert returncode == 0, f"{where}: {shlex.join(help_command(key)[1:])} failed:\n{err[-3000:]}"
    known = flags_in_help(out)
    own = [f for f in flags_of(args) if f in known]
    if module in FORWARDS_TO_TRAIN:
        known |= flags_in_help(train_help())
    unknown = [f for f in flags_of(args) if f not in known]
    assert not unknown, f"{where}: {module} knows no {unknown}"
    if module in FORWARDS_TO_TRAIN:
        # what the tool hands train.py's parser: the line less the tool's own flags (and their values)
        rest, i = [], 0
        while i < len(args):
            name = args[i].split("=", 1)[0]
            if name in own and name not in flags_in_help(train_help()):
                takes_value = "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("-")
                i += 2 if takes_value else 1
            else:
                rest.append(args[i])
                i += 1
        parse_train_args(where, rest)
    if module == "tools.bench" and "--only" in args:
        bench = module_source("tools/bench")
        start = args.index("--only") + 1
        names = []
        for arg in args[start:]:
            if arg.startswith("-"):
                break
            names.append(arg)
        unknown = [n for n in names if f'"{n}"' not in bench]
        assert names and not unknown, f"{where}: tools/bench/ --only knows no {unknown or 'name given'}"


def check_pytest(where, args):
    tests = os.path.join(REPO, "tests")
    named = [a.split("::")[0] for a in args if a.endswith(".py") or "::" in a]
    missing = [a for a in named if not os.path.exists(os.path.join(REPO, a))]
    assert not missing, f"{where}: no such test file {missing}"
    if "-k" in args:
        files = named or [os.path.join("tests", f) for f in os.listdir(tests) if f.startswith("test_")]
        haystack = " ".join(files)
        for f in files:
            with open(os.path.join(REPO, f)) as source:
                haystack += source.read()
        words = set(re.findall(r"\w+", args[args.index("-k") + 1])) - {"and", "or", "not"}
        unknown = [w for w in sorted(words) if w not in haystack]
        assert not unknown, f"{where}: -k names {unknown}, which no test of {files} has"


@pytest.mark.parametrize("where,tokens", COMMANDS, ids=[f"{where} {shlex.join(t)[:60]}" for where, t in COMMANDS])
def test_command_line_runs(where, tokens, helps):
    if tokens[0] == "torchrun":
        script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
        check_torchrun_flags(where, tokens[1:script], helps)
        if script is None:
            return  # a mention of torchrun's own flags in a sentence (`torchrun --max-restarts 3`), checked above
        name, args = tokens[script], tokens[script + 1:]
        if name == "train.py":
            parse_train_args(where, args)
        elif name in SELF_CHECKS:
            # the self-checks themselves run in tests/test_copy.py and each dimension's tests (test_dp.py, ...)
            path = os.path.join(REPO, name)
            assert os.path.isfile(path), f"{where}: no {name}"
            with open(path) as f:
                assert 'if __name__ == "__main__":' in f.read(), f"{where}: {name} has no self-check to run"
            assert not args, f"{where}: {name}'s self-check takes no arguments"
        else:
            pytest.fail(f"{where}: torchrun of {name}, which this test does not know how to check")
        return
    args = tokens[1:]
    if args == ["-m", "tools.NAME"]:
        pass  # the general form, in the sentence before the file table
    elif args[:1] == ["-m"] and args[1:2] and args[1].startswith("tools."):
        check_tool(where, tokens, helps)
    elif args[:2] == ["-m", "pytest"]:
        check_pytest(where, args[2:])
    elif args[:1] == ["-m"] and args[1:2] and args[1] in STDLIB_MODULES:
        pass
    elif args[:1] == ["train.py"]:
        parse_train_args(where, args[1:])
    elif args[:1] == ["plot.py"]:
        returncode, out, err = helps[("script", "plot.py")]
        assert returncode == 0, f"python plot.py --help failed:\n{err[-3000:]}"
        unknown = [f for f in flags_of(args[1:]) if f not in flags_in_help(out)]
        assert not unknown, f"{where}: plot.py knows no {unknown}"
    else:
        pytest.fail(f"{where}: {shlex.join(tokens)!r}: a command this test does not know how to check "
                    "(a file moved? tools run as python -m tools.NAME)")


def test_the_pages_have_the_commands_they_should():
    """A guard on the collection above: the pages' commands are found, every kind of them."""
    lines = [shlex.join(tokens) for _, tokens in COMMANDS]
    assert len(lines) >= 30, lines
    for needle in ["train.py", "plot.py", "pytest", *(f"-m tools.{name}" for name in TOOLS), *SELF_CHECKS]:
        assert any(needle in line for line in lines), f"no command line of README.md or docs/ with {needle!r}"


CPU_INSTALL = "pip install torch==2.13.0 -r requirements.txt"  # the CPU build the suite is tested with
GPU_INSTALL = "pip install -r requirements.txt"  # into the Python that holds a GPU machine's torch


def install_lines():
    """The README's two install lines: a fresh CPU machine's (a virtual environment, torch's CPU build) and a
    GPU machine's (the Python that holds its torch)."""
    lines = [line for _, line in bash_lines(README)]
    cpu = next((line for line in lines if CPU_INSTALL in line), "")
    gpu = next((line for line in lines if line.startswith(GPU_INSTALL)), "")
    return cpu, gpu


def test_the_readme_installs_and_tests_as_ci_does():
    """The front door keeps the whole install and both tiers' test commands, and .ci/run runs the install and
    the whole suite's."""
    cpu, gpu = install_lines()
    for step in ["python3 -m venv .venv", ". .venv/bin/activate", CPU_INSTALL]:
        assert step in cpu, f"README.md's install line lacks {step!r}: {cpu!r}"
    assert gpu, f"README.md has no GPU machine's install line, `{GPU_INSTALL} ...`"
    lines = [line for _, line in bash_lines(README)]
    for command in ("python -m pytest -q", "python -m pytest -q --full"):
        assert command in lines, f"README.md has no line `{command}`, a tier's test command"
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    assert CPU_INSTALL.replace("pip install", "pip install -q") in ci, ".ci/run no longer installs as README.md"
    assert "\npython -m pytest -q --full\n" in ci, ".ci/run no longer runs the whole suite"


def test_a_gpu_machines_torch_2_11_satisfies_its_install_offline(tmp_path):
    """The GPU machine has torch 2.11 (a CUDA build) and no package index: its README line, run by pip with no
    index and no configuration (no local wheels either), finds everything satisfied and installs nothing, so
    it keeps that torch. The torch 2.11 here is its metadata alone, ahead of this environment's torch on the
    path, as pip finds installed packages; the rest is what this environment has installed."""
    _, gpu = install_lines()
    installed = tmp_path / "torch-2.11.0+cu130.dist-info"
    installed.mkdir()
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}  # this machine's local wheels
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONPATH=str(tmp_path))
    command = shlex.split(gpu.split("&&")[0].strip())[1:]  # pip install -r requirements.txt
    out = subprocess.run([sys.executable, "-m", "pip", *command, "--dry-run", "--no-index"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=HELP_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Requirement already satisfied: torch" in out.stdout and "(2.11.0+cu130)" in out.stdout, out.stdout
    assert "Would install" not in out.stdout, out.stdout


def test_the_readme_is_a_front_door():
    n_lines = TEXTS[README].count("\n")
    assert n_lines <= FRONT_DOOR_LINES, f"README.md has {n_lines} lines: move a topic into a page of docs/"


PY_PATH = re.compile(r"(?<![\w./<>-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w])")
RESULTS_PATH = re.compile(r"(?<![\w./<>-])(results/[\w./-]*\w)")


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_exists(page):
    """name.py at the top level, dir/name.py and results/name.ext where they are said to be."""
    text = TEXTS[page]
    missing = sorted({(m.group(1), line_of(m.start(), text)) for pattern in (PY_PATH, RESULTS_PATH)
                      for m in pattern.finditer(text) if not os.path.exists(os.path.join(REPO, m.group(1)))})
    assert not missing, f"{page} names files that do not exist (a bare name.py means the top folder): " + \
        ", ".join(f"{name} (line {line})" for name, line in missing)


FILE_EXTENSIONS = {"py", "bin", "pkl", "json", "jsonl", "png", "md", "txt", "safetensors", "pt"}
CODE_NAME = re.compile(r"`([A-Za-z_][\w.]*)\.(\w+)`")


@functools.cache
def repository_modules():
    """{module name as imported: its file}: the top level's, and training's and tools' by their package (a
    package of tools/, such as tools/plan/, by its folder)."""
    modules = {f[:-3]: f for f in os.listdir(REPO) if f.endswith(".py")}
    for package in ("training", "tools"):
        for f in os.listdir(os.path.join(REPO, package)):
            if f.endswith(".py") and f != "__init__.py":
                modules[f"{package}.{f[:-3]}"] = f"{package}/{f}"
            elif os.path.isfile(os.path.join(REPO, package, f, "__init__.py")):
                modules[f"{package}.{f}"] = f"{package}/{f}"
    return modules


def module_source(path):
    """The source of a module's file, or of every module of a package's folder."""
    path = os.path.join(REPO, path)
    files = [path] if path.endswith(".py") else sorted(glob.glob(os.path.join(path, "*.py")))
    source = ""
    for name in files:
        with open(name) as f:
            source += f.read() + "\n"
    return source


@pytest.mark.parametrize("page", PAGES)
def test_every_module_name_in_code_exists(page):
    """Inline code such as `dp.Shard` or `training.hf.config_from_hf`: the module is this repository's, and
    it defines the name (a moved module is named by its package: `training.hf`, not `hf`)."""
    modules = repository_modules()
    moved = {name.split(".")[1]: name for name in modules if "." in name}
    problems = []
    prose = without_fences(TEXTS[page])
    for m in CODE_NAME.finditer(prose):
        module, name = m.groups()
        if name in FILE_EXTENSIONS:
            continue  # a file's name, checked above
        where = f"{page}:{line_of(m.start(), prose)}: `{module}.{name}`"
        if module in moved and module not in modules:
            problems.append(f"{where}: {module} is now {moved[module]}")
        elif module in modules:
            source = module_source(modules[module])
            if not re.search(rf"^\s*(?:class|def)\s+{name}\b|^{name}\s*(?::[^=\n]*)?=", source, re.M):
                problems.append(f"{where}: {modules[module]} defines no {name}")
    assert not problems, "\n".join(problems)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@functools.cache
def anchors_of(page):
    """The anchors of a page's headings, GitHub's way (a repeated heading's with -1, -2, ...)."""
    anchors = set()
    for m in re.finditer(r"^#{1,6} (.+)$", without_fences(TEXTS[page]), re.M):
        anchor, n = slug(m.group(1)), 1
        while anchor in anchors:
            anchor, n = f"{slug(m.group(1))}-{n}", n + 1
        anchors.add(anchor)
    return anchors


LINK = re.compile(r"\]\(([^)\s]+)\)")


def links_of(page):
    """[(line, target page or file relative to REPO, anchor or None)] of a page's links to this repository."""
    found, text = [], TEXTS[page]
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue  # https: and the like: not this repository's
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        found.append((line_of(m.start(), text), where, anchor or None))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_link_finds_its_file_and_section(page):
    broken = []
    for line, target, anchor in links_of(page):
        if target.startswith("..") or not os.path.exists(os.path.join(REPO, target)):
            broken.append(f"{page}:{line}: no {target} (paths are relative to the page's folder)")
        elif anchor and target not in TEXTS:
            broken.append(f"{page}:{line}: {target}#{anchor}: a section of a file that is not a page")
        elif anchor and anchor not in anchors_of(target):
            broken.append(f"{page}:{line}: {target} has no section #{anchor} ({sorted(anchors_of(target))})")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_page():
    linked = {target for _, target, _ in links_of(README)}
    unlinked = [page for page in PAGES[1:] if page not in linked]
    assert not unlinked, f"pages of docs/ that README.md's list of pages does not link: {unlinked}"


# The sections of the article "5D Parallelism from Scratch", in its order: each needs a row of the reading map
# whose first cell says it (a pattern, case ignored).
ARTICLE_SECTIONS = {
    "Why do we need parallelism?": r"why",
    "Data parallelism": r"^data parallelism",
    "ZeRO": r"zero",
    "Tensor parallelism": r"^tensor parallelism",
    "Pipeline parallelism: GPipe and 1F1B": r"^pipeline parallelism.*gpipe.*1f1b",
    "The project's schedules: interleaved and zero bubble": r"interleaved.*zb-h1.*zb-v",
    "Sequence parallelism, Megatron-style": r"^sequence parallelism.*megatron",
    "Ring attention (context parallelism)": r"ring attention.*context parallelism",
    "Expert parallelism": r"^expert parallelism",
    "The load balancing challenge": r"load balancing",
    "Putting it all together: the 5D grid": r"all together.*5d grid",
}


def reading_map():
    """[(line, cells)] of the rows of the README's reading map (its section's table, header left out)."""
    text = TEXTS[README]
    section = re.search(r"^## The reading map\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no section '## The reading map'"
    rows = []
    for m in re.finditer(r"^\|(.*)\|$", section.group(1), re.M):
        cells = [cell.strip() for cell in m.group(1).split("|")]
        if not set("".join(cells)) <= set("-: ") and cells[0] != "section of the article":
            rows.append((line_of(section.start(1) + m.start(), text), cells))
    return rows


def test_the_reading_map_has_a_row_for_each_section_of_the_article():
    rows = reading_map()
    firsts = [cells[0].lower() for _, cells in rows]
    missing = [section for section, pattern in ARTICLE_SECTIONS.items()
               if not any(re.search(pattern, first) for first in firsts)]
    assert not missing, f"the reading map has no row for {missing} (rows: {firsts})"
    order = [next(i for i, first in enumerate(firsts) if re.search(pattern, first))
             for pattern in ARTICLE_SECTIONS.values()]
    assert order == sorted(order), "the reading map's rows are not in the article's order"


def test_every_name_in_the_reading_map_is_in_the_code():
    """Each `module.Name` of the map imports: the module is this repository's and has the attribute."""
    modules = repository_modules()
    problems, named = [], 0
    for line, cells in reading_map():
        names = [m.groups() for m in CODE_NAME.finditer(" ".join(cells)) if m.group(2) not in FILE_EXTENSIONS]
        if not names:
            problems.append(f"README.md:{line}: a row of the reading map that names no `module.Name`")
        for module, name in names:
            named += 1
            if module not in modules:
                problems.append(f"README.md:{line}: `{module}.{name}`: no module {module} in this repository")
            elif not hasattr(importlib.import_module(module), name):
                problems.append(f"README.md:{line}: `{module}.{name}`: {modules[module]} has no {name}")
    assert named >= 2 * len(ARTICLE_SECTIONS), f"the reading map names only {named} classes and functions"
    assert not problems, "\n".join(problems)


def test_the_reading_map_runs_each_dimension_as_its_docstring_says():
    """Each self-check in the map is the command its file's docstring gives, and every row has a command."""
    problems = []
    for line, cells in reading_map():
        commands = [code for code in re.findall(r"`([^`]+)`", cells[-1]) if code.split()[0] in PYTHONS + ("torchrun",)]
        if not commands:
            problems.append(f"README.md:{line}: no command in the row's last cell {cells[-1]!r}")
        for command in commands:
            script = command.split()[-1]
            if script in SELF_CHECKS:
                with open(os.path.join(REPO, script)) as f:
                    docstring = f.read().split('"""')[1]
                if command not in " ".join(docstring.split()):
                    problems.append(f"README.md:{line}: {script}'s docstring does not give `{command}`")
    assert not problems, "\n".join(problems)


def test_the_reading_maps_first_figure_is_the_planners_and_the_articles():
    """The first row's Llama 3 8B figure, as its command plans it: 16 bytes a parameter (the article's
    count), the activations beside them, and their sum, each as the row states it (to the GiB)."""
    from tools import plan
    row = next(line for line in TEXTS[README].splitlines() if line.startswith("| Why do we need parallelism?"))
    stated = re.search(r"([\d,]+) GiB = ([\d.]+) B parameters × the article's 16 bytes .*?= ([\d,]+) GiB, plus "
                       r"([\d,]+) GiB of activations", row)
    total, billions, states, activations = (float(g.replace(",", "")) for g in stated.groups())
    args = train.parse_args(["--model", "llama3-8b", "--arch", "llama"])
    predicted = {field: values[0] / 2**30 for field, values in plan.predict(args, 8).items()}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(cli.model_config(args, cli.data_vocab_size(args))).parameters())
    assert round(n_params / 1e9, 2) == billions
    assert round(predicted["param_bytes"] + predicted["grad_bytes"] + predicted["optim_bytes"]) == states \
        == round(n_params * 16 / 2**30)
    assert round(predicted["activation_peak_bytes"]) == activations
    assert round(sum(predicted[f] for f in ("param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes"))) \
        == total
