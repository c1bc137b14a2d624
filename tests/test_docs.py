"""Every code block of the README and docs/ is checked against the code, so none can rot.

- ```python blocks run, each from a file of its own in a fresh directory (a block meant
  for a script must carry its ``if __name__ == "__main__":`` guard: the workers are spawned);
- ```bash blocks: every command line is parsed by the real command-line parser (a flag
  that is gone or renamed fails); ``./dev help`` runs. The commands themselves run in their
  own tests (test_demo_cli, test_bench, test_doctor, test_stress); ``./dev test`` is this suite;
- the Layout block of the README names every module of the package and nothing else.
"""
import ast
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from sharedmp import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.S | re.M)


def blocks(lang):
    """(id, text) of every fenced block of language ``lang`` ("" for none) in DOCS."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                line = text.count("\n", 0, m.start()) + 1
                found.append((f"{doc.relative_to(ROOT)}:{line}", m.group(2)))
    return found


def _ids(items):
    return [i for i, _ in items]


PYTHON = blocks("python")
BASH = blocks("bash")
# Libraries ./dev installs for Python 3.11 only (torch, the demo's): a block that needs one
# is skipped on the other interpreters, where it is not installed; a block that fails for
# want of any other module fails.
ONLY_ON_3_11 = {"torch", "sklearn", "tqdm"}
MISSING = re.compile(r"^ModuleNotFoundError: No module named '([\w.]+)'$", re.M)


def test_the_docs_have_blocks_of_each_kind():
    assert len(PYTHON) >= 2 and len(BASH) >= 2 and blocks("")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where,code", PYTHON, ids=_ids(PYTHON))
def test_python_block_runs_from_a_file(where, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAREDMP_")}
    try:
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the block at {where} did not finish in {e.timeout} s")
    missing = MISSING.search(r.stderr)
    if r.returncode != 0 and missing:
        name = missing.group(1).partition(".")[0]
        if name in ONLY_ON_3_11 and importlib.util.find_spec(name) is None:
            pytest.skip(f"the block at {where} needs {name}, not installed for this Python")
    assert r.returncode == 0, f"the block at {where} failed:\n{code}\n{r.stdout}\n{r.stderr}"


def _commands(text):
    """The command lines of a bash block: continuations joined, comments dropped."""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def _sharedmp_argv(words):
    """The arguments given to `python -m sharedmp` by a command line, or None for ./dev test."""
    if words[0] == "./dev":
        return None if words[1:2] in (["test"], ["help"]) else words[1:]
    for i in range(len(words) - 1):
        if words[i:i + 2] == ["-m", "sharedmp"]:
            return words[i + 2:]
    raise AssertionError(f"a bash block runs {shlex.join(words)!r}: teach tests/test_docs.py "
                         "how to check it")


@pytest.mark.parametrize("where,text", BASH, ids=_ids(BASH))
def test_bash_block_commands_parse(where, text):
    for words in _commands(text):
        argv = _sharedmp_argv(words)
        if argv is None:
            continue
        parser, module = cli.build_parser(argv)
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{shlex.join(words)}` is refused by the parser")
        assert module is not None and args.command == argv[0]


def test_dev_help_lists_every_command():
    r = subprocess.run([str(ROOT / "dev"), "help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    for name in ("test", "demo", *cli.COMMANDS):
        assert re.search(rf"\b{name}\b", r.stdout), f"./dev help does not mention {name}"


def _layout_paths(text):
    """Paths named by the Layout block: a line at column 0 is a root, indented ones are under it."""
    paths, root = set(), ""
    for line in text.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        if not line.startswith(" "):
            root = names
            paths.add(root)
            continue
        first, *rest = [n.strip() for n in names.split(",")]
        paths.add(root + first)
        folder = first.rpartition("/")[0]
        paths.update(root + (folder + "/" if folder else "") + n for n in rest)
    return paths


def test_readme_layout_matches_the_tree():
    (where, text), = [b for b in blocks("") if b[1].startswith("src/sharedmp/")]
    named = _layout_paths(text)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the Layout block at {where} names what is not there: {missing}"
    package = ROOT / "src" / "sharedmp"
    unnamed = []
    for f in sorted(package.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        parents = {p.relative_to(ROOT).as_posix() + "/" for p in f.parents if package in p.parents}
        if f.name in ("__init__.py", "__main__.py"):     # packages are named by their folder
            continue
        if rel not in named and not parents & named:
            unnamed.append(rel)
    assert not unnamed, f"the Layout block at {where} leaves out {unnamed}"


# -- the API reference ---------------------------------------------------------------------

REFERENCE = ROOT / "docs" / "reference.md"
ENTRY = re.compile(r"^### `([\w.]+)(?:\((.*)\))?`$", re.M)
MODULES = {"mp": "sharedmp", "training": "sharedmp.training",
           "distributed": "sharedmp.distributed", "joblib": "sharedmp.joblib"}
# The library a module of MODULES needs: its entries are checked where that is installed
# (torch: Python 3.11 here, ./dev).
NEEDS = {"training": "torch", "distributed": "torch", "joblib": "joblib"}


def _checkable(prefix):
    return prefix not in NEEDS or importlib.util.find_spec(NEEDS[prefix]) is not None


def reference_entries():
    """{qualified name: documented parameter text or None} of docs/reference.md."""
    return {m.group(1): m.group(2) for m in ENTRY.finditer(REFERENCE.read_text())}


def _resolve(qualified):
    prefix, _, name = qualified.partition(".")
    module = importlib.import_module(MODULES[prefix])
    return getattr(module, name)


def _documented_parameters(text):
    """[(kind, name)] of a documented parameter list, read as Python would read it."""
    args = ast.parse(f"def f({text}): pass").body[0].args
    return ([("positional", a.arg) for a in args.posonlyargs + args.args]
            + ([("var", args.vararg.arg)] if args.vararg else [])
            + [("keyword", a.arg) for a in args.kwonlyargs]
            + ([("varkw", args.kwarg.arg)] if args.kwarg else []))


def _code_parameters(obj):
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.VAR_POSITIONAL: "var", inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "varkw"}
    return [(kinds[p.kind], p.name) for p in inspect.signature(obj).parameters.values()]


def own_public_names():
    """sharedmp's names whose meaning is its own: not the standard library's objects."""
    import multiprocessing

    import sharedmp as mp
    names = {n for n in mp.__all__
             if getattr(mp, n) is not getattr(multiprocessing, n, None)}
    return names | {"ENV_VAR_PARALLEL_START", "SpawnContext", "init_reductions",
                    "_set_thread_name", "_get_thread_name"}


def test_every_public_name_has_a_reference_entry():
    entries = reference_entries()
    missing = sorted(n for n in own_public_names() if f"mp.{n}" not in entries)
    for prefix in filter(_checkable, ["training", "distributed", "joblib"]):
        module = importlib.import_module(MODULES[prefix])
        missing += sorted(f"{prefix}.{n}" for n in module.__all__ if f"{prefix}.{n}" not in entries)
    assert not missing, f"docs/reference.md has no entry for {missing}"


def test_reference_entries_name_the_code_parameters():
    wrong = []
    for qualified, text in reference_entries().items():
        if text is None or qualified in ("mp._set_thread_name", "mp._get_thread_name"):
            continue                     # no parameters given; torch's own helpers
        if not _checkable(qualified.partition(".")[0]):
            continue
        obj = _resolve(qualified)
        if _documented_parameters(text) != _code_parameters(obj):
            wrong.append(f"{qualified}: documented ({text}), code {_code_parameters(obj)}")
    assert not wrong, "\n".join(wrong)


def test_every_environment_variable_is_documented():
    read = set()
    for f in (ROOT / "src" / "sharedmp").rglob("*.py"):
        read |= set(re.findall(r"\b(SHAREDMP_[A-Z_]+)", f.read_text()))
    read.discard("SHAREDMP_STRESS_RUN")          # stress's mark on its own processes
    text = REFERENCE.read_text()
    missing = sorted(v for v in read if f"| `{v}` |" not in text)
    assert not missing, f"docs/reference.md's table lacks {missing}"


# -- one home for each fact: docs/reference.md states the defaults and limits, quoted from
#    the code's constants; the README and docs/API.md link to it -----------------------------

def _ordinal(n):
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _facts():
    from sharedmp import wire
    from sharedmp.channels import flow
    from sharedmp.reductions import ndarray
    return [
        f"a {_ordinal(flow._FRACTION_OF_AVAILABLE)} of the memory available, at most "
        f"{_size(flow.DEFAULT)} and at least {_size(flow._MIN)}",
        f"stay within {_size(wire.INBAND_MAX)} (`wire.INBAND_MAX`",
        f"up to {_size(ndarray.STD_BY_VALUE_MAX)} an array (`STD_BY_VALUE_MAX`",
    ]


def test_the_reference_states_the_limits_the_code_has():
    text = " ".join((ROOT / "docs" / "reference.md").read_text().split())
    missing = [fact for fact in _facts() if fact not in text]
    assert not missing, f"docs/reference.md does not say (the code's constants): {missing}"


def test_the_reference_gives_each_settings_default():
    from sharedmp import settings
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", (ROOT / "docs" / "reference.md").read_text(),
                           re.M))
    wrong = {}
    for name, var in settings.VARIABLES.items():
        default = var.default
        if isinstance(default, bool) or default is None:
            continue                                  # (stated in words)
        if isinstance(default, float) and default.is_integer():
            expected = f"`{int(default)}`"
        elif isinstance(default, int) and default >= 1 << 20:
            expected = _size(default)
        else:
            expected = f"`{default}`"
        if name not in rows or expected not in rows[name]:
            wrong[name] = (rows.get(name), expected)
    assert not wrong, f"docs/reference.md's table of variables against settings.py: {wrong}"


def test_the_limits_are_stated_only_in_the_reference():
    # The README and docs/API.md link to it instead (a number said twice drifts apart).
    from sharedmp import wire
    from sharedmp.channels import flow
    from sharedmp.reductions import ndarray
    numbers = [_size(wire.INBAND_MAX), _size(ndarray.STD_BY_VALUE_MAX),
               f"a {_ordinal(flow._FRACTION_OF_AVAILABLE)} of the memory"]
    for doc in (ROOT / "README.md", ROOT / "docs" / "API.md"):
        text = " ".join(doc.read_text().split())
        said = [n for n in numbers if n in text]
        assert not said, f"{doc.name} states {said}: link to docs/reference.md instead"


# The fork-freeze figure, why a DataLoader worker forked by a sharedmp context freezes what it
# inherits ($SHAREDMP_FREEZE_FORKED): the latest measurement, that of commit 85b60d5 (issue 40:
# the "228 -> 107 MiB" before it was not reproduced). Its one home is `mp.get_context` in
# docs/reference.md; the README, docs/API.md and the table of differences link there, and a
# docstring that recalls it must say the same.
FREEZE_FIGURE = "1 worker: 137-141 MiB not frozen, 90-95 frozen; 4 workers: 85-95 MiB either way"
_FREEZING = re.compile(r"gc\.freeze|\bfrozen\b|\bfreez(?:e|es|ing)\b|FREEZE_FORKED")
_FIGURES = re.compile(r"\b\d+(?:-\d+)?(?=\s*MiB)|\b\d+-\d+\b")     # 90 MiB, 90-95 (MiB)


def _sentences(text):
    """The sentences of ``text``, whitespace joined; each row of a table, as one."""
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("|")]
    prose = " ".join(" ".join(line for line in lines if not line.startswith("|")).split())
    return rows + re.split(r"(?<=\.)\s+", prose)


def _prose(path):
    """The text of a doc; of a module, its comments and strings (docstrings), apart."""
    if path.suffix != ".py":
        return path.read_text()
    parts = []
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string.lstrip("#"))
            elif tok.type == tokenize.STRING:
                parts.append(f". {tok.string}. ")
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                parts.append(". ")
    return " ".join(parts)


def _freeze_figures(path):
    """The sentences of ``path`` that give a figure of the freeze (in MiB, or a range)."""
    return [s for s in _sentences(_prose(path)) if _FREEZING.search(s) and _FIGURES.search(s)]


def test_the_fork_freeze_figure_has_one_home():
    home = " ".join(REFERENCE.read_text().split())
    assert FREEZE_FIGURE in home, f"docs/reference.md, mp.get_context, lacks {FREEZE_FIGURE!r}"
    for doc in DOCS:
        elsewhere = [s for s in _freeze_figures(doc)
                     if not (doc == REFERENCE and FREEZE_FIGURE in s)]
        assert not elsewhere, (f"{doc.relative_to(ROOT)} states the fork-freeze figure: link to "
                               f"docs/reference.md#mpget_contextmethodnone instead: {elsewhere}")
    figure = set(_FIGURES.findall(FREEZE_FIGURE))
    for f in sorted((ROOT / "src" / "sharedmp").rglob("*.py")):
        for s in _freeze_figures(f):
            other = sorted(set(_FIGURES.findall(s)) - figure)
            assert not other, (f"{f.relative_to(ROOT)} gives the fork-freeze figure as {other}, "
                               f"docs/reference.md as {FREEZE_FIGURE!r}: {s}")
