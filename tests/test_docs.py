"""The docs' own check: every command in README.md and docs/*.md still runs, every link resolves.

Commands are the lines of fenced blocks marked ```bash, ```sh or ```console (in a console block,
only the lines that start with `$ `, the rest being output). A line ending in `\\` goes on in the
next; a trailing `# comment` is dropped; `;`, `&&` and `||` separate commands; leading
`NAME=value` words (environment) are dropped. Each command must be one of these, checked so:

- `python -m launch …` (also `python3`, `.venv/bin/python`): the kit's own parser takes the
  subcommand and every flag (as `launch`'s main does, in this process); where it takes settings
  (config, submit, sweep, prepare), `python -m launch config` resolves them (--mode, --nodes,
  --config, every key=value; a sweep's every grid point) and exits 0. Nothing is submitted.
- `slurm-ddp-kit …` (the console command): as `python -m launch …`, or `python -m analysis` for
  `summarize`.
- `python -m analysis …`, `python -m train …`: their parser takes every word; train's settings
  resolve as above.
- `python -m pytest PATH …`: every path exists.
- `sbatch [OPTION …] slurm/X.sbatch [WORD …] [-- python SCRIPT …]`: the script exists, and the
  words after it resolve as the script's own `launch prepare --mode M` would take them; a program
  after `--` (here and in `python -m launch`) runs a script of the repository's.
- `make [TARGET] [NAME=value …]`: the target is one of the Makefile's.
- `bash SCRIPT …`, `path/to/SCRIPT …`: the script exists. Of `NAME=$(command)`, the command.
- `export NAME=value`, `source .venv/bin/activate` (what `make install` makes): nothing to run.

Anything else fails, unless its line ends in `# unchecked: WHY` (say why it cannot run here: a
download, another program's install). Keep those rare.

Links: every `[text](target)` of those files, outside code, that is not a URL names an existing
file or folder; a `#anchor` into a Markdown file names one of its headings (GitHub's slug).

Also: README.md stays a six-minute read (at most 1,500 words, as `wc -w` counts), and its quick
start carries no test-suite figures (they live in docs/benchmarks/test-suite.md).
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from kit import REPO, kit_here

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)")
UNCHECKED = re.compile(r"#\s*unchecked:\s*\S")
PYTHONS = {"python", "python3", ".venv/bin/python"}


def _blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of each fenced block."""
    blocks: list[tuple[int, str, list[str]]] = []
    lines: list[str] = []
    inside, lang, start, indent = False, "", 0, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if not inside and fence:
            inside, indent, lang, start, lines = True, fence.group(1), fence.group(2), number, []
        elif inside and line.strip() == "```":
            blocks.append((start, lang, lines))
            inside = False
        elif inside:
            lines.append(line.removeprefix(indent))
    return blocks


def _commands() -> list[tuple[str, str]]:
    """(where, command line) of every command in the docs."""
    found = []
    for path in DOCS:
        for start, lang, lines in _blocks(path):
            if lang not in ("bash", "sh", "console"):
                continue
            pending, first = "", 0
            for offset, line in enumerate(lines, 1):
                if lang == "console":
                    if not line.startswith("$ ") and not pending:
                        continue
                    line = line.removeprefix("$ ")
                if not pending:
                    first = start + offset
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                text = (pending + line).strip()
                pending = ""
                if text and not text.startswith("#"):
                    found.append((f"{path.relative_to(REPO)}:{first}", text))
    return found


COMMANDS = _commands()


def _split(text: str) -> list[list[str]]:
    """The commands of one line, as words: comments dropped, split at ; && ||; of
    `NAME=$(command)`, the command."""
    text = re.sub(r"^[A-Za-z_]\w*=\$\((.*)\)\s*(#.*)?$", r"\1", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in (";", "&&", "||"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [
        words[next((i for i, w in enumerate(words) if not _assignment(w)), len(words)) :]
        for words in commands
        if words
    ]


def _assignment(word: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) is not None


@pytest.mark.parametrize(("where", "text"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_runs(where: str, text: str) -> None:
    if UNCHECKED.search(text):
        return
    for words in _split(text):
        _check(words, where)


def _check(words: list[str], where: str) -> None:
    program, *args = words
    if program in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
        module, *rest = args[1:]
        if module == "pytest":  # the paths it names (an option's value is no path)
            for arg in rest:
                if arg.startswith("tests/"):
                    assert (REPO / arg.split("::")[0]).exists(), f"{where}: no {arg}"
        else:
            assert module in ("launch", "analysis", "train"), f"{where}: python -m {module}?"
            _check_kit(module, rest, where)
    elif program == "slurm-ddp-kit":  # the console command: launch's, and analysis' summarize
        _check_kit("analysis" if args[:1] == ["summarize"] else "launch", args, where)
    elif program == "sbatch":
        _check_sbatch(args, where)
    elif program == "make":
        targets = [a for a in args if not _assignment(a) and not a.startswith("-")]
        for target in targets:
            assert target in _make_targets(), f"{where}: the Makefile has no target {target!r}"
    elif program == "bash":
        assert args and (REPO / args[0]).is_file(), f"{where}: no script {args[:1]}"
    elif "/" in program and not program.startswith("."):  # a script of the repository's, run
        assert (REPO / program).is_file(), f"{where}: no script {program}"
    elif program == "export":
        assert all(_assignment(a) for a in args), f"{where}: export of {args}"
    elif program == "source":
        assert args == [".venv/bin/activate"], f"{where}: source {args}"
    else:
        pytest.fail(f"{where}: {' '.join(words)!r} is none of the commands this test checks; "
                    "end its line in `# unchecked: why` if it cannot run here")  # fmt: skip


def _check_kit(module: str, args: list[str], where: str) -> None:
    """The module's own parser takes every word; settings resolve through `launch config`."""
    import importlib

    parser = importlib.import_module({
        "launch": "slurm_ddp_kit.launch.cli", "analysis": "slurm_ddp_kit.analysis.__main__",
        "train": "slurm_ddp_kit.train.__main__",
    }[module])._parser()  # fmt: skip
    args, program = _program_apart(args, where) if module == "launch" else (args, [])
    try:
        parsed, extra = parser.parse_known_args(args)
    except SystemExit as end:  # --version and --help end here with 0
        assert end.code == 0, f"{where}: python -m {module} refuses {args} (exit {end.code})"
        return
    # As launch's main: key=value words after a flag are settings; anything else is refused.
    unknown = [e for e in extra if e.startswith("-") or "overrides" not in parsed]
    assert not unknown, f"{where}: python -m {module} does not take {unknown}"
    if extra:
        parsed.overrides = [*parsed.overrides, *extra]
    if module == "analysis":
        fmt = getattr(parsed, "format", "markdown")
        assert fmt in ("markdown", "csv", "json"), f"{where}: --format {fmt}"
    if hasattr(parsed, "overrides"):  # config, submit, sweep, prepare; train's data commands
        _resolve(parsed, where, ("--", *program) if program else ())


def _program_apart(args: list[str], where: str) -> tuple[list[str], list[str]]:
    """The kit's words, and a user's program after `--` (as launch's main splits them), which
    must run a script of the repository's."""
    if "--" not in args:
        return args, []
    args, program = args[: args.index("--")], args[args.index("--") + 1 :]
    script = next((w for w in program if w.endswith(".py")), None)
    assert program[:1] == ["python"] and script and (REPO / script).is_file(), (
        f"{where}: the program {program} names no script of the repository"
    )
    return args, program


def _resolve(parsed: argparse.Namespace, where: str, extra: tuple[str, ...] = ()) -> None:
    """`python -m launch config` with the command's settings: exit 0."""
    words = [f"--config={f}" for f in getattr(parsed, "config_files", None) or []]
    for flag in ("mode", "nodes"):
        if getattr(parsed, flag, None) is not None:
            words.append(f"--{flag}={getattr(parsed, flag)}")
    points: list[tuple[str, ...]] = [()]
    if getattr(parsed, "grid", None) is not None:  # a sweep: each point, each mode
        from slurm_ddp_kit.launch import sweep

        sweep._check_grid_against_overrides(parsed.grid, parsed.overrides)
        modes = parsed.modes.split(",")
        points = [(f"mode={m}", *p) for m in modes for p in sweep.grid(parsed.grid, len(modes))]
    for point in points:
        done = kit_here("launch", "config", *words, *parsed.overrides, *extra, *point)
        assert done.returncode == 0, f"{where}: its settings are refused: {done.stderr.strip()}"


def _check_sbatch(args: list[str], where: str) -> None:
    script = next((a for a in args if a.endswith(".sbatch")), None)
    assert script and (REPO / script).is_file(), f"{where}: no batch script in {args}"
    mode = re.search(r"launch prepare --shell --mode (\w+)", (REPO / script).read_text())
    assert mode, f"{script}: no `launch prepare --mode` line"
    words, program = _program_apart(args[args.index(script) + 1 :], where)
    from slurm_ddp_kit.launch import cli

    parsed, extra = cli._parser().parse_known_args(
        ["prepare", "--shell", "--mode", mode[1], *words]
    )
    assert not [e for e in extra if e.startswith("-")], f"{where}: the script does not take {extra}"
    parsed.overrides = [*parsed.overrides, *extra]
    _resolve(parsed, where, ("cluster.backend=slurm", *(("--", *program) if program else ())))


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.MULTILINE))


# ---- links ----------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, with their numbers, inline code blanked."""
    lines, inside = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def _slugs(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (outside fenced blocks)."""
    counts: dict[str, int] = {}
    slugs, inside = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and (heading := re.match(r"#{1,6}\s+(.*)", line)):
            text = heading[1].strip().lower()
            slug = "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")
            slugs.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
            counts[slug] = counts.get(slug, 0) + 1
    return slugs


LINKS = [
    (f"{path.relative_to(REPO)}:{number}", path, target)
    for path in DOCS
    for number, line in _prose(path)
    for match in LINK.finditer(line)
    if not re.match(r"[a-z]+:", target := match[1] or match[2])
]


@pytest.mark.parametrize(("where", "path", "target"), LINKS, ids=[w for w, _, _ in LINKS])
def test_link_resolves(where: str, path: Path, target: str) -> None:
    file, _, anchor = target.partition("#")
    found = (path.parent / file).resolve() if file else path
    assert found.exists(), f"{where}: {target} names no file"
    if anchor and found.suffix == ".md":
        assert anchor in _slugs(found), f"{where}: {found.name} has no heading #{anchor}"


def test_the_docs_have_commands_and_links() -> None:
    """The extraction itself: it finds the README's and the guide's commands and links."""
    files = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/commands.md", "docs/cluster.md"} <= files
    assert len(COMMANDS) > 40 and len(LINKS) > 50


def test_readme_is_a_six_minute_read() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.split()) <= 1500, "README.md: at most 1,500 words; move detail to docs/"
    assert "make demo" in text and "make test" in text
    assert not re.search(r"\d+ passed", text), "test-suite figures go to docs/benchmarks"
