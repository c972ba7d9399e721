"""The command line agrees with itself (issue 32, item 5): every command that takes a schedule
offers every schedule, one default bandwidth, one default for --straight, `--version`, help
with no command, and `train --help` with the common flags first. A reader that stops reading
early ends a command without a traceback. Every relative link in the README and docs/ leads
to a file. Parsers, a simulation in unit costs and Markdown only: no profiling, planning or
training.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version

import pytest

import pipedream_fast
from pipedream_fast import cli
from pipedream_fast.commands import DEFAULT_BANDWIDTH
from pipedream_fast.schedules import SCHEDULE_NAMES


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(found) == 1
    return dict(found[0].choices)


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


def test_every_command_lists_its_module() -> None:
    assert list(subcommands()) == list(cli.COMMAND_MODULES)


def test_every_command_that_takes_a_schedule_offers_every_schedule_and_auto() -> None:
    """Where a command cannot do with one (simulate, auto) it refuses it with a message,
    tested with the command; the choices stay the same everywhere."""
    taking = {name: option(p, "--schedule") for name, p in subcommands().items()}
    taking = {name: action for name, action in taking.items() if action is not None}
    assert {"plan", "simulate", "train"} <= set(taking)
    for name, action in taking.items():
        assert action.choices is not None
        assert list(action.choices) == [*SCHEDULE_NAMES, "auto"], name


def test_one_default_bandwidth() -> None:
    taking = {name: option(p, "--bandwidth") for name, p in subcommands().items()}
    taking = {name: action for name, action in taking.items() if action is not None}
    assert {"simulate", "train"} <= set(taking)
    for name, action in taking.items():
        assert action.default == DEFAULT_BANDWIDTH, name
        assert "default 1e9" in (action.help or ""), name  # the help says the same value


def test_every_command_that_takes_straight_has_one_default_and_help() -> None:
    """`plan` plans a profile as `train` does: one rank per stage unless --no-straight."""
    taking = {name: option(p, "--straight") for name, p in subcommands().items()}
    taking = {name: action for name, action in taking.items() if action is not None}
    assert {"plan", "train"} <= set(taking)
    for name, action in taking.items():
        assert isinstance(action, argparse.BooleanOptionalAction), name
        assert "--no-straight" in action.option_strings, name
        assert action.default is True, name
    assert len({action.help for action in taking.values()}) == 1, taking


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"pipedream-fast {pipedream_fast.__version__}\n"
    try:  # setup.py's, as installed: the same as the source's
        assert installed_version("pipedream_fast") == pipedream_fast.__version__
    except PackageNotFoundError:  # a checkout on sys.path, not installed: the source's
        pass


def test_no_command_prints_the_help_with_every_command(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert cli.main([]) == 2  # a usage error, as argparse's
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("usage: pipedream-fast")
    for name in cli.COMMAND_MODULES:
        assert f"\n    {name} " in out.err, name  # listed with its one-line help
    assert out.err.rstrip().endswith(f"no command given; choose one of "
                                     f"{', '.join(cli.COMMAND_MODULES)}")


def test_train_help_puts_the_common_flags_first_and_every_flag_in_a_group() -> None:
    train = subcommands()["train"]
    groups = [g for g in train._action_groups if g._group_actions]
    titles = [g.title for g in groups]
    assert titles[:2] == ["options", "common"]  # argparse's own (-h), then ours
    assert [a.dest for a in groups[0]._group_actions] == ["help"]
    common = {a.dest for a in groups[1]._group_actions}
    assert {"model", "data", "schedule", "nproc", "threads", "steps", "epochs",
            "out"} <= common
    assert {"planning", "pipeline options", "schedule options", "tuning",
            "output"} <= set(titles)
    assert titles.index("planning") < titles.index("tuning")
    schedule_flags = next(g for g in groups if g.title == "schedule options")
    assert "local_steps" in {a.dest for a in schedule_flags._group_actions}
    usage = train.format_usage()
    assert len(usage.splitlines()) <= 2 and "[options]" in usage


def test_simulate_refuses_auto_saying_what_to_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--schedule", "auto", "--stages", "2", "--microbatches", "4",
                     "--unit-cost"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "pipedream-fast plan --schedule auto" in err and "--plan" in err


ROOT = Path(__file__).resolve().parent.parent


def test_a_reader_that_stops_early_ends_the_command_quietly() -> None:
    """`pipedream-fast simulate ... | head -3`: the reader is gone before the command writes
    (closed at once, so the write fails every time, not only when the pipe is full). The
    command ends as `cat` would, with no traceback, and exit code 1 (rich's, which the
    commands' tables exit with there)."""
    command = [sys.executable, "-m", "pipedream_fast.cli", "simulate", "--schedule", "1f1b",
               "--stages", "2", "--microbatches", "4", "--unit-cost"]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == cli.BROKEN_PIPE_EXIT, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


class ClosedPipe:
    """A stdout whose reader is gone."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_is_exit_code_1_in_process_too(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                     "--unit-cost"]) == cli.BROKEN_PIPE_EXIT
    assert cli.main(["--version"]) == cli.BROKEN_PIPE_EXIT  # argparse's output, flushed


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces
    made hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-"))
    return found


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not code blocks
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
