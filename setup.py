"""Build pipedream_fast and its C++ core `pipedream_fast._C` (torch.utils.cpp_extension, ninja).

CPU build (default):  pip install --no-build-isolation -e .
CUDA build: done automatically when torch sees a GPU; FORCE_CUDA=1 builds the CUDA code
without a GPU (compile-only check), with CUDA_HOME and TORCH_CUDA_ARCH_LIST set.
Build without isolation so the extension is compiled against the torch that imports it.
"""

import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as err:  # pragma: no cover - a message for people building by hand
    raise SystemExit(
        "pipedream_fast builds against an installed torch. Install it first "
        "(CPU: pip install torch==2.13.0), then: pip install --no-build-isolation -e .") from err

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        if CUDA_HOME is None:
            raise SystemExit("FORCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME")
        if torch.version.cuda is None:
            raise SystemExit("FORCE_CUDA=1 needs a CUDA build of torch, found " + torch.__version__)
        return True
    return torch.cuda.is_available() and CUDA_HOME is not None


def pip_cuda_dirs() -> tuple[list[str], list[str]]:
    """Header and library folders of the CUDA libraries that a pip-installed CUDA torch brings
    (nvidia-* wheels). A toolkit that ships only nvcc lacks cusparse.h and friends, which
    ATen's CUDA headers include."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return [], []
    roots = [os.path.join(base, sub) for base in nvidia.__path__ for sub in sorted(os.listdir(base))]
    includes = [os.path.join(r, "include") for r in roots if os.path.isdir(os.path.join(r, "include"))]
    libs = [os.path.join(r, "lib") for r in roots if os.path.isdir(os.path.join(r, "lib"))]
    return includes, libs


def extension():
    sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    cxx_flags = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
    if want_cuda():
        include_dirs, library_dirs = pip_cuda_dirs()
        return CUDAExtension("pipedream_fast._C", sources,
                             include_dirs=include_dirs, library_dirs=library_dirs,
                             define_macros=[("PIPEDREAM_FAST_WITH_CUDA", None)],
                             extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]})
    return CppExtension("pipedream_fast._C", sources, extra_compile_args={"cxx": cxx_flags})


setup(
    name="pipedream_fast",
    version="0.1.0",
    description="Pipeline-parallel training for PyTorch after PipeDream: profiler, planner, "
                "schedules (PipeDream async, 2BW, 1F1B, GPipe), simulator and a C++ runtime core",
    packages=find_packages(include=["pipedream_fast", "pipedream_fast.*"]),
    # The typing of the package (PEP 561): its py.typed marker and the stub of the C++ core.
    package_data={"pipedream_fast": ["py.typed", "_C.pyi"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "rich>=13", "numpy", "scikit-learn", "safetensors>=0.4"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "pytest-benchmark>=4", "numpy",
                 "mypy", "ruff"],
        "plot": ["matplotlib>=3.7"],
        # The model zoo of the tests (public model code built from configs). torchvision is
        # left to the user: it pins torch exactly (CPU: pip install torchvision==0.28.0 with
        # torch==2.13.0), and an unpinned one would replace torch with another build.
        "zoo": ["transformers>=4.46", "timm>=1.0"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["pipedream-fast=pipedream_fast.cli:main"]},
)
