"""The bench-only C++ extension `pipedream_fast_bench` (`ThreadedProducer`: a native thread
pushing into a `pipedream_fast._C.ActivationQueue`), so none of it ships in the library: `load()`
builds bench/csrc/*.cpp with csrc/activation_queue.cpp into build/bench_ext/ on first use.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build" / "bench_ext"
_module: ModuleType | None = None


def missing_tools() -> str | None:
    """Why the extension cannot be built here (a missing compiler or ninja), or None."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH) to build the bench extension"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja): the bench extension builds with it"
    return None


def load(verbose: bool = False) -> ModuleType:
    """The built module (compiled on the first call if no cached build is current)."""
    global _module
    if _module is None:
        from torch.utils import cpp_extension

        from pipedream_fast import _C  # the queue type must be registered before ours binds it

        flags = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers"]
        if _C.cuda_enabled:  # a Bundle carries a CUDA event then: the layouts must agree
            flags.append("-DPIPEDREAM_FAST_WITH_CUDA")
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        sources = [*sorted((ROOT / "bench" / "csrc").glob("*.cpp")),
                   ROOT / "csrc" / "activation_queue.cpp"]
        _module = cpp_extension.load(
            name="pipedream_fast_bench", sources=[str(p) for p in sources],
            extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "bench" / "csrc")],
            extra_cflags=flags, with_cuda=bool(_C.cuda_enabled),
            build_directory=str(BUILD_DIR), verbose=verbose)
    return _module
