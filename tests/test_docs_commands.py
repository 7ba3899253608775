"""Every shell line of the README and docs/ that calls `dspark-run` or `dspark-export` names a command, options and
choices that exist (a renamed option fails here), and the README's own lines run for real, in order, in a fresh
folder with a fresh DSPARK_HOME (all but the interactive chat and the server, which other tests drive)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from dspark_export.cli import main as export_main
from dspark_runtime.cli import main as run_main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"dspark-run": run_main, "dspark-export": export_main}
FENCE = re.compile(r"^```(bash|sh|console)\n(.*?)^```", re.M | re.S)


def shell_lines(page: Path) -> list[str]:
    """The calls of our two programs in a page's shell blocks: continuations joined, `$ ` prompts and pipes into
    them dropped, variables set earlier in the same block expanded."""
    found = []
    for _, block in FENCE.findall(page.read_text(encoding="utf-8")):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ").strip()
            assignment = re.fullmatch(r'(\w+)="([^"]*)"', line)
            if assignment:
                variables[assignment[1]] = assignment[2]
                continue
            for name, value in variables.items():
                line = line.replace("$" + name, value)
            line = line.split("|")[-1].strip()
            if line.split(" ")[0] in PROGRAMS:
                found.append(line)
    return found


def resolve(words: list[str]) -> tuple[click.Command, list[str]]:
    """The command a line runs (`dspark-run [ENGINE]` is the chat command) and its arguments."""
    program, args = PROGRAMS[words[0]], words[1:]
    if program is run_main and (not args or (args[0] not in program.commands and args[0] not in ("--version",))):
        args = ["chat", *args]
    if not args or args[0].startswith("-"):
        return program, args
    return program.commands[args[0]], args[1:]


def problems(line: str) -> list[str]:
    """What in the line the command would refuse by name: unknown options, values outside a Choice."""
    command, args = resolve(shlex.split(line, comments=True))
    options = {name: param for param in command.params if isinstance(param, click.Option)
               for name in (*param.opts, *param.secondary_opts)}
    found = []
    for index, arg in enumerate(args):
        name = arg.split("=")[0]
        if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d.*", arg):
            continue
        if name not in options:
            found.append(f"{command.name}: unknown option {name}")
            continue
        param = options[name]
        value = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else None)
        if isinstance(param.type, click.Choice) and not param.is_flag and value not in param.type.choices:
            found.append(f"{command.name} {name}: {value!r} is not one of {param.type.choices}")
    return found


CALLS = [(page.name, line) for page in PAGES for line in shell_lines(page)]


def test_the_pages_show_commands():
    readme = [line for name, line in CALLS if name == "README.md"]
    assert len(readme) >= 7 and len(CALLS) >= 30


@pytest.mark.parametrize("page, line", CALLS, ids=[f"{page}:{line[:60]}" for page, line in CALLS])
def test_every_documented_call_names_what_exists(page, line):
    assert problems(line) == []


def test_a_renamed_option_is_caught():
    assert problems("dspark-export inspect --target qwen3-8b --slots 4") == ["inspect: unknown option --slots"]
    assert problems("dspark-run bench ENGINE --modes off --json") == []
    assert problems("dspark-export build --target demo --weights int3 --out x") != []


def test_the_readme_lines_run(tmp_path):
    env = os.environ | {"DSPARK_HOME": str(tmp_path / "home")}
    skipped = {("dspark-run",), ("dspark-run", "serve")}
    ran = 0
    for line in shell_lines(ROOT / "README.md"):
        words = shlex.split(line, comments=True)
        if tuple(words[:2]) in skipped or tuple(words) in skipped:
            continue
        result = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        ran += 1
    assert ran >= 6


def test_sample_outputs_are_what_the_commands_print_today():
    """A `console` block's output lines equal the command's (the `weights` line, which names this machine's
    folders, excepted)."""
    checked = 0
    for page in PAGES:
        for kind, block in FENCE.findall(page.read_text(encoding="utf-8")):
            if kind != "console":
                continue
            command, *shown = block.strip().splitlines()
            words = shlex.split(command.removeprefix("$ "))
            result = subprocess.run(words, capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            printed = result.stdout.strip().splitlines()
            assert len(printed) == len(shown)
            kept = [(a, b) for a, b in zip(printed, shown) if not b.startswith("weights ")]
            assert [a for a, _ in kept] == [b for _, b in kept]
            checked += 1
    assert checked


def test_the_readme_python_example_prints_both_replies(tmp_path, monkeypatch, capsys):
    """The README's Python block, run as written: `generate` and `stream` each print text."""
    (code,) = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    printed = capsys.readouterr().out
    answer = scope["out"].text
    assert answer.strip() and printed.startswith(answer)
    assert printed[len(answer):].split("\n", 1)[1].strip()  # the streamed reply, after generate's line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_pages_resolves():
    """README.md's and docs/'s links to files of the repository name files that exist, and headings that do."""
    dangling = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file = (page.parent / target).resolve() if target else page
            if not file.exists():
                dangling.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {slug(h) for h in headings}:
                    dangling.append(f"{page.name}: {target}#{anchor}")
    assert dangling == []
