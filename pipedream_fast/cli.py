"""`pipedream-fast` command line: one sub-command per module in `pipedream_fast.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` as the parser default. This file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pipedream_fast.formats import FormatError

# The order here is the order in `--help`: the flow, left to right.
COMMAND_MODULES = ("profile", "plan", "simulate", "train", "run", "export")


class UsageError(Exception):
    """Bad command-line input that argparse cannot catch; printed without a traceback."""


def version() -> str:
    """The installed package's version (its metadata), else the source's `__version__` (a
    checkout on sys.path, not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pipedream_fast")
    except PackageNotFoundError:
        from pipedream_fast import __version__
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipedream-fast",
        description="Profile, plan, simulate and train pipeline-parallel PyTorch models.",
        epilog="`pipedream-fast COMMAND --help` describes a command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # Not required: with no command, `main` prints this help (which lists the commands),
    # where argparse would print only its usage line and "required: COMMAND".
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"pipedream_fast.commands.{name}").register(sub)
    return parser


# The exit code when the reader of stdout goes away early (`pipedream-fast ... | head -3`):
# rich's, which the commands' tables already exit with there.
BROKEN_PIPE_EXIT = 1


def main(argv: Sequence[str] | None = None) -> int:
    """The `pipedream-fast` entry point. A reader that stops reading early (`| head -3`) ends
    the command quietly, as it ends `cat`: no traceback, exit code 1. Not by restoring
    SIGPIPE's default action, which would kill a rank process whose peer's socket closes."""
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse's --help, --version and usage errors
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, not at exit, where Python reports a failure on its own
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return BROKEN_PIPE_EXIT


def _stdout_to_devnull() -> None:
    """Point the stdout file descriptor at /dev/null, so that Python's final flush of what is
    still buffered succeeds instead of reporting the closed pipe once more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured, in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a usage error (exit 2, on stderr), with the commands listed
        parser.print_help(sys.stderr)
        print(f"\n{parser.prog}: error: no command given; choose one of "
              f"{', '.join(COMMAND_MODULES)}", file=sys.stderr)
        return 2
    from pipedream_fast.launch import LaunchError

    try:
        return int(args.func(args) or 0)
    except (UsageError, FormatError, FileNotFoundError, ValueError) as err:
        print(f"pipedream-fast {args.command}: error: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:  # a rank failed or was stopped: its report, not ours
        print(f"pipedream-fast {args.command}: {err}", file=sys.stderr)
        return err.exit_code or 1
    except KeyboardInterrupt:
        print(f"pipedream-fast {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run as a script, this module is `__main__`, whose UsageError is not the one the
    # commands raise: hand over to the imported module.
    from pipedream_fast.cli import main as imported_main
    sys.exit(imported_main())
