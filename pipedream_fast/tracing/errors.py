"""The tracing errors, and how a failure is reported: the user's line that failed and why."""

from __future__ import annotations

import linecache
import os
import traceback

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class TracingError(ValueError):
    """A model cannot be split into blocks (untraceable code, shared parameters, bad inputs).

    Its message names the cause and a remedy that works, so a one-line report of the failure
    (`user_errors.describe`) keeps this message rather than the error it was raised from."""

    remedy_in_message = True


class FxUntraceable(TracingError):
    """torch.fx could not follow some module's forward: `module_path` names it ("" for the
    model's own forward, where no leaf can help); `failure` is the message without the remedy,
    `remedy` the fix alone."""

    def __init__(self, failure: str, remedy: str, module_path: str) -> None:
        super().__init__(f"{failure}; {remedy}")
        self.failure = failure
        self.remedy = remedy
        self.module_path = module_path


class NeedsExampleInputs(TracingError):
    """torch.fx could not trace the model; capturing it with torch.export needs example
    inputs (a Pipeline then cuts the model at its first minibatch)."""


def _failing_line(err: BaseException) -> str:
    """The deepest frame of the traceback outside torch itself and this package: the user's
    code that failed."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and not os.path.dirname(os.path.abspath(f.filename)) == _PACKAGE_DIR]
    if not frames:
        return ""
    f = frames[-1]
    line = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f" at {os.path.basename(f.filename)}:{f.lineno}: `{line}`"


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
