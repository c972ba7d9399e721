"""`package.module:attribute` specs, as `--model` and `--data` take them for user factories."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any


def import_factory(spec: str, what: str, error: type[ValueError], example: str) -> Callable[..., Any]:
    """The callable `spec` names; `error` (naming `what`, with `example`) if it names none.
    The working directory is importable, as under `python -m`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{spec!r} is not MODULE:FACTORY (e.g. {example!r})")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise error(f"cannot import {module_name!r} for {what} {spec!r}: "
                    f"{type(err).__name__}: {err}") from err
    factory = getattr(module, attr, None)
    if factory is None:
        raise error(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})")
    if not callable(factory):
        raise error(f"{spec!r} is a {type(factory).__name__}, not a callable factory")
    return factory
