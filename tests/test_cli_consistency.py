"""The command line agrees with itself (issue 32, item 5): every command that takes a schedule
offers every schedule, one default bandwidth, `--version`, help with no command, and
`train --help` with the common flags first. Parsers only: no profiling, planning or training.
"""

from __future__ import annotations

import argparse
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
