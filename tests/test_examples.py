"""The examples run: each plain script in one process, each pipeline script on 2 ranks
(`pipedream-fast run --nproc 2`), for a few steps of small minibatches; and each pipeline
script is its plain script with a few lines changed."""

from __future__ import annotations

import ast
import difflib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
QUICK = {  # a few steps of a small model: CI checks that they run, not how well they train
    "cnn": ["--steps", "3", "--batch-size", "16", "--log-every", "1"],
    "lm": ["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--layers", "2",
           "--dim", "32", "--log-every", "1"],
}
# One intra-op thread per process: the ranks share the machine's cores.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_example(name: str, kind: str) -> subprocess.CompletedProcess[str]:
    script = str(EXAMPLES / f"{name}_{kind}.py")
    if kind == "plain":
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2", script]
    return subprocess.run([*command, *QUICK[name]], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("kind", ["plain", "pipeline"])
@pytest.mark.parametrize("name", ["cnn", "lm"])
def test_example_runs_and_reports(name, kind):
    result = run_example(name, kind)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    # Every step's loss, once: a pipeline prints on rank 0 only.
    steps = re.findall(r"^step (\d+) loss (\S+)$", out, re.M)
    assert [int(s) for s, _ in steps] == [1, 2, 3], out
    assert all(math.isfinite(float(loss)) for _, loss in steps), out
    tests = re.findall(r"^test loss (\S+)", out, re.M)
    assert len(tests) == 1 and math.isfinite(float(tests[0])), out
    if name == "cnn":
        accuracy = re.findall(r"^test loss \S+ accuracy (\S+)$", out, re.M)
        assert len(accuracy) == 1 and 0.0 <= float(accuracy[0]) <= 1.0, out
    else:
        assert re.search(r"^test loss \S+ \(\S+ bits per character\)$", out, re.M), out
    plans = re.findall(r"^plan: .*on ranks", out, re.M)
    assert len(plans) == (1 if kind == "pipeline" else 0), out


def code_lines(path: Path) -> list[str]:
    """The script without its module docstring."""
    text = path.read_text()
    tree = ast.parse(text)
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return text.splitlines()[first.end_lineno:]


@pytest.mark.parametrize("name", ["cnn", "lm"])
def test_the_pipeline_script_is_the_plain_script_with_a_few_lines_changed(name):
    plain, pipeline = EXAMPLES / f"{name}_plain.py", EXAMPLES / f"{name}_pipeline.py"
    diff = [line for line in difflib.unified_diff(code_lines(plain), code_lines(pipeline),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(diff) <= 40, "\n".join(diff)
    assert any("pdf.Pipeline(" in line for line in diff)
    assert any("pipe.train(loader" in line for line in diff)
    assert any("pipe.evaluate(" in line for line in diff)
    # The pipeline script's docstring says what changed and how to see it.
    assert f"diff examples/{name}_plain.py examples/{name}_pipeline.py" in pipeline.read_text()
