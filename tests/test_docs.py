"""The documentation is executed: every code block runs, or says why it does not.

Sources: README.md, CHANGELOG.md, slurm/README.md and docs/**/*.rst. Code
blocks are Markdown fences (```python / ```bash) and reST
``.. code-block::`` directives. The rules, for every **python** block:

* first line ``# fragment: <why>``: not run (it is a piece of a larger
  program on purpose; the reason must be given);
* a leading comment line ``# ranks: serial``: run as ``python block.py``,
  without a launcher;
* a leading comment line ``# ranks: N [N ...]``: run under
  ``mpiexec -n N`` for each N;
* neither: run under ``mpiexec -n 2``.

Each run has a timeout (``MPIEXEC_TIMEOUT`` for MPICH's hydra and the
subprocess timeout) and a fresh working directory; it must exit with 0.

**Shell** blocks (bash, sh, console) are not run, but every ``credit-mpi``
command in them must parse with the real command's argument parser, and
docs/cli.rst must name every option of every subcommand (and nothing else).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from credit_mpi import cli

from .conftest import ROOT, child_env

TIMEOUT = int(os.environ.get("DOC_TIMEOUT", "180"))
PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str

    @property
    def id(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "slurm" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.rst"))
    return [f for f in files if f.is_file() and "_build" not in f.parts and "api" not in f.relative_to(ROOT).parts[1:2]]


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def markdown_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(Block(path, i + 2, lang.lower(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


_DIRECTIVE = re.compile(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\S*)")


def rst_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            i += 1
            continue
        base, lang = len(m.group(1)), m.group(2).lower()
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].strip().startswith(":")) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base
        ):
            j += 1  # options (:linenos:) and the blank line before the body
        body, first = [], j
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base):
            body.append(lines[j])
            j += 1
        while body and not body[-1].strip():
            body.pop()
        width = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        blocks.append(Block(path, first + 1, lang, "\n".join(b[width:] for b in body) + "\n"))
        i = j
    return blocks


def all_blocks() -> list[Block]:
    out = []
    for path in doc_files():
        out += markdown_blocks(path) if path.suffix == ".md" else rst_blocks(path)
    return out


BLOCKS = all_blocks()
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang in PYTHON_LANGS]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]


def plan(block: Block) -> list[int] | str:
    """``"fragment"``, or the rank counts to run the block on (0 = serially, without a launcher)."""
    lines = block.code.splitlines()
    first = lines[0].strip() if lines else ""
    if first.startswith("# fragment:"):
        if not first[len("# fragment:") :].strip():
            raise ValueError(f"{block.id}: '# fragment:' needs a reason after the colon")
        return "fragment"
    for line in lines:
        line = line.strip()
        if not line.startswith("#"):
            break
        if line.startswith("# ranks:"):
            words = line[len("# ranks:") :].split()
            if words == ["serial"]:
                return [0]
            if not words or not all(w.isdigit() and int(w) > 0 for w in words):
                raise ValueError(f"{block.id}: '# ranks:' takes 'serial' or positive rank counts, got {line!r}")
            return [int(w) for w in words]
    return [2]


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


# -- the extractor itself ------------------------------------------------------


def test_extractors_find_blocks(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("text\n```python\nprint(1)\n```\n\n```bash\nls\n```\n")
    assert [(b.lang, b.code, b.line) for b in markdown_blocks(md)] == [("python", "print(1)\n", 3), ("bash", "ls\n", 7)]
    rst = tmp_path / "a.rst"
    rst.write_text("Title\n\n.. code-block:: python\n\n   x = 1\n\n   y = 2\n\nafter\n")
    (block,) = rst_blocks(rst)
    assert (block.lang, block.code, block.line) == ("python", "x = 1\n\ny = 2\n", 5)


def test_plan_markers(tmp_path):
    def b(code):
        return Block(tmp_path / "x.md", 1, "python", code)

    assert plan(b("# fragment: needs a model\nx\n")) == "fragment"
    assert plan(b("# ranks: 2 4\nx\n")) == [2, 4]
    assert plan(b("# train.py\n# ranks: serial\nx\n")) == [0]
    assert plan(b("import x\n# ranks: 4\n")) == [2]  # only leading comments count
    with pytest.raises(ValueError, match="needs a reason"):
        plan(b("# fragment:\nx\n"))
    with pytest.raises(ValueError, match="positive rank counts"):
        plan(b("# ranks: two\n"))


def test_the_docs_have_blocks():
    assert len(PYTHON_BLOCKS) >= 5 and len(SHELL_BLOCKS) >= 5, [b.id for b in BLOCKS]
    for block in PYTHON_BLOCKS:
        plan(block)  # every marker is well formed
    assert any(plan(b) != "fragment" for b in PYTHON_BLOCKS)


# -- run every python block -----------------------------------------------------

RUNS = [
    pytest.param(block, n, id=f"{block.id}-{'serial' if n == 0 else f'n{n}'}")
    for block in PYTHON_BLOCKS
    if plan(block) != "fragment"
    for n in plan(block)
]


@pytest.mark.parametrize(("block", "ranks"), RUNS)
def test_python_block_runs(block, ranks, tmp_path):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own mpiexec: run it from a single process (pytest, not under mpiexec)")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = child_env(MPIEXEC_TIMEOUT=str(TIMEOUT), PYTHONUNBUFFERED="1")
    command = [sys.executable, str(script)] if ranks == 0 else [_mpiexec(), "-n", str(ranks), sys.executable, str(script)]
    try:
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT + 30)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} on {ranks or 'no launcher'} rank(s) did not finish in {TIMEOUT + 30} s:\n{exc.stderr}")
    assert result.returncode == 0, (
        f"{block.id} on {ranks or 'no launcher, 1'} rank(s) exited {result.returncode}\n--- code:\n{block.code}"
        f"--- stdout:\n{result.stdout[-3000:]}\n--- stderr:\n{result.stderr[-5000:]}"
    )


# -- credit-mpi commands in shell blocks -------------------------------------------


def credit_mpi_commands(block: Block) -> list[list[str]]:
    """The arguments after ``credit-mpi`` (or ``python -m credit_mpi``) on each line of a shell block."""
    found = []
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for k, word in enumerate(words):
            if word == "credit-mpi" or (word == "credit_mpi" and k >= 2 and words[k - 1] == "-m"):
                args = []
                for w in words[k + 1 :]:
                    if w in ("|", "&&", ";", "||", ">", "2>&1") or w.startswith(">"):
                        break
                    args.append(w)
                found.append(args)
                break
    return found


SHELL_COMMANDS = [
    pytest.param(args, id=f"{block.id}:{' '.join(args)}") for block in SHELL_BLOCKS for args in credit_mpi_commands(block)
]


def test_shell_blocks_use_credit_mpi():
    assert len(SHELL_COMMANDS) >= 5


@pytest.mark.parametrize("args", SHELL_COMMANDS)
def test_shell_command_parses(args, capsys):
    parser = cli.build_parser()
    if args in (["--version"], ["--help"], ["-h"]) or "--help" in args or "-h" in args:
        with pytest.raises(SystemExit) as info:
            parser.parse_args(args)
        assert info.value.code == 0
        return
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"`credit-mpi {' '.join(args)}` is refused by the command: {capsys.readouterr().err}")
        raise AssertionError from exc


def _subcommands() -> dict:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return {"": parser, **dict(sub.choices)}


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def _cli_rst_sections() -> dict[str, str]:
    """docs/cli.rst split at each ``credit-mpi <sub>`` definition term; '' is the text before the first."""
    text = (ROOT / "docs" / "cli.rst").read_text()
    sections, current = {"": ""}, ""
    for line in text.splitlines():
        m = re.match(r"^``credit-mpi (\w+)", line)
        if m:
            current = m.group(1)
            sections.setdefault(current, "")
        elif line and not line[0].isspace():
            current = ""  # body text at the left margin is general again
        sections[current] += line + "\n"
    return sections


def test_cli_rst_documents_every_option():
    sections = _cli_rst_sections()
    subs = _subcommands()
    assert set(sections) == set(subs), f"docs/cli.rst documents {sorted(sections)}, the command has {sorted(subs)}"
    for name, parser in subs.items():
        text = sections[name]
        named = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))
        options = _options(parser)
        missing = sorted(o for o in options if o not in named)
        assert not missing, f"docs/cli.rst, `credit-mpi {name}`: options of the command not documented: {missing}"
        unknown = sorted(o for o in named if o not in options and o not in ("-n", "-m", "--help", "-h"))  # mpiexec -n, python -m
        assert not unknown, f"docs/cli.rst, `credit-mpi {name}`: options that the command does not have: {unknown}"


@pytest.mark.parametrize("name", sorted(set(_subcommands()) - {""}))
def test_help_of_every_subcommand_works(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args([name, "--help"])
    assert info.value.code == 0
    assert f"usage: credit-mpi {name}" in capsys.readouterr().out


def test_api_reference_lists_every_public_name_once():
    import credit_mpi

    text = (ROOT / "docs" / "api.rst").read_text()
    documented = re.findall(r"^\.\. auto(?:function|class|exception):: ([\w.]+)", text, flags=re.M)
    public = [n for n in credit_mpi.__all__ if n != "__version__"]
    public += ["HaloExchange", "init_torch_distributed", "destroy_torch_distributed"]  # the lazy, torch-only names
    import credit_mpi.io
    import credit_mpi.nn

    public += [n for n in credit_mpi.nn.__all__ if n != "HaloExchange"]  # documented once, as credit_mpi.HaloExchange
    public += credit_mpi.io.__all__
    for name in public:
        assert documented.count(name) == 1, f"docs/api.rst documents {name} {documented.count(name)} times"
    assert len(documented) == len(set(documented)), documented
    internal = {"transport", "autograd", "partition", "validation", "bench", "cli", "demo"}
    assert not [d for d in documented if set(d.split(".")) & internal]


# -- every credit_mpi name and credit-mpi command a page mentions exists ----------------------------------

# (not a communicator's name such as credit_mpi.domain[0], which the watchdog's reports show)
_DOTTED = re.compile(r"(?<![\w/.-])(credit_mpi|cm|dp)((?:\.[A-Za-z_]\w*)+)(?![\w\[])")
_INLINE_COMMAND = re.compile(r"``(credit-mpi [^`]+)``|(?<!`)`(credit-mpi [^`]+)`(?!`)")


def _page_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.rst") if p.name != "changelog.rst")]


def documented_names() -> list[tuple[str, str]]:
    """``(page:line, dotted name)`` for every ``credit_mpi.X.Y`` (or ``cm.X`` / ``dp.X``, the pages' aliases)."""
    found = []
    for path in _page_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for alias, rest in _DOTTED.findall(line):
                if alias != "credit_mpi" and not re.search(rf"`[^`]*\b{alias}{re.escape(rest)}", line):
                    continue  # cm./dp. only inside code, where they are the pages' import aliases
                found.append((f"{path.name}:{number}", "credit_mpi" + rest))
    return found


def _resolve(dotted: str) -> None:
    """Import the longest module prefix of ``dotted`` and look the rest up (AttributeError / ImportError)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("credit_mpi"):
                pytest.skip(f"{dotted} needs {exc.name}, which is not installed")
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(dotted)


NAMES = sorted({name for _, name in documented_names()})


def test_pages_name_credit_mpi_things():
    assert len(NAMES) > 20, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_named_credit_mpi_thing_exists(name):
    where = [w for w, n in documented_names() if n == name]
    try:
        _resolve(name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(f"{', '.join(where)} names {name}, which does not exist ({type(exc).__name__}: {exc})")


def inline_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in _page_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for a, b in _INLINE_COMMAND.findall(line):
                text = a or b
                if "<" in text or "..." in text or "[" in text:
                    continue  # a synopsis with placeholders (docs/cli.rst is checked option by option)
                out.append((f"{path.name}:{number}", shlex.split(text)[1:]))
    return out


@pytest.mark.parametrize(("where", "args"), inline_commands(), ids=[w for w, _ in inline_commands()])
def test_inline_credit_mpi_commands_name_real_options(where, args):
    """Prose mentions (``credit-mpi bench --plot``): the subcommand and every option named exist."""
    subs = _subcommands()
    name = args[0] if args and not args[0].startswith("-") else ""
    assert name in subs, f"{where}: `credit-mpi {' '.join(args)}`: no subcommand {name!r} (there are {sorted(subs)[1:]})"
    options = _options(subs[name]) | {"-h", "--help"} | (_options(subs[""]) if name == "" else set())
    unknown = [a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in options]
    assert not unknown, f"{where}: `credit-mpi {' '.join(args)}`: {name or 'credit-mpi'} has no option {unknown}"


def test_the_name_check_catches_what_does_not_exist(tmp_path):
    with pytest.raises(AttributeError):
        _resolve("credit_mpi.no_such_function")
    with pytest.raises((AttributeError, ImportError)):
        _resolve("credit_mpi.cli.grid.check_grid")  # the module that `credit-mpi info --grid` once imported
    assert ("README.md", "credit_mpi.abort_on_exception") in {(w.split(":")[0], n) for w, n in documented_names()}


INTERNAL = ("credit_mpi.partition", "credit_mpi.validation", "credit_mpi.transport", "credit_mpi.autograd",
            "credit_mpi.cli.", "attach_torch_groups", "detach_torch_groups")


def test_guide_pages_do_not_send_users_to_internal_names():
    """docs/architecture.rst describes the internals (for contributors); the guide pages name only public things."""
    offending = [
        f"{path.name}:{number}: {name}"
        for path in sorted((ROOT / "docs").glob("*.rst")) if path.name not in ("changelog.rst", "api.rst", "architecture.rst")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for name in INTERNAL if name in line
    ]
    assert not offending, offending


# -- every pip install a page shows names something that exists -------------------------------------------

_PIP = re.compile(r"pip install ([^`#\n]+)")


def pip_targets() -> list[tuple[str, str]]:
    """``(page:line, target)`` for every argument of a ``pip install`` in README and docs (options dropped)."""
    out = []
    for path in [*_page_files(), ROOT / "slurm" / "README.md"]:
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in _PIP.finditer(line):
                try:
                    words = shlex.split(m.group(1))
                except ValueError:
                    continue
                skip = False
                for w in words:
                    if skip:
                        skip = False
                        continue
                    if w in ("--index-url", "--extra-index-url", "-d", "--no-binary", "-r"):
                        skip = True
                    elif w.startswith("-") or w.startswith("MPICC"):
                        continue
                    else:
                        out.append((f"{path.name}:{number}", w.rstrip(")")))
    return out


def test_pip_install_targets_exist():
    """A checkout (`.`, `./credit_mpi`), the wheel of `make wheel` with its real name, or a package on PyPI;
    extras that pyproject.toml defines; never `credit-mpi` by name (it is on no index)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, version = set(project["optional-dependencies"]), project["version"]
    wheel = f"dist/credit_mpi-{version}-py3-none-any.whl"
    targets = pip_targets()
    assert len(targets) > 5, targets
    bad = []
    for where, target in targets:
        base, _, rest = target.partition("[")
        named = set(rest.rstrip("]").split(",")) - {""} if rest else set()
        if base.replace("_", "-").lower().startswith("credit-mpi"):
            bad.append(f"{where}: {target} (credit_mpi is on no package index: use a checkout or the wheel)")
        elif base in (".", "./credit_mpi") or base.startswith("dist/"):
            if base.startswith("dist/") and base != wheel:
                bad.append(f"{where}: {target} (make wheel builds {wheel})")
            if named - extras:
                bad.append(f"{where}: {target} (no extra {sorted(named - extras)}; pyproject has {sorted(extras)})")
    assert not bad, "\n".join(bad)
