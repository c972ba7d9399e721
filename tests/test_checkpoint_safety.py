"""Checkpoints and exports that lose nothing, load strictly and never destroy what they read.

One 2-process job (`job`) trains a model with an embedding tied to its output head (across the
two stages, as nanoGPT's `lm_head.weight` is `transformer.wte.weight`) and a non-persistent
buffer (as Llama's `rotary_emb.inv_freq`), with periodic saves, then tries what must be
refused (a save into a user's folder, a second run in the same `checkpoint_dir`) and resumes.
The tests then check, in this process:

* A: `state_dict()` and export hold exactly the model's `state_dict()` keys, and a fresh model
  loads them with `strict=True` and computes what the trained one computes;
* B: `pipedream-fast export --out m.safetensors` loads with `safetensors.torch.load_model`;
* C: export refuses an output inside the checkpoint it reads, a directory, a missing folder;
* D: a manifest that is not what the library writes is refused in one line;
* E: a save never deletes a user's files;
* F: one run per `checkpoint_dir`: a second run is refused at construction, a resumed run
  keeps its id, pruning touches only its own run, a folder of two runs is not guessed at.
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.cli import main
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from runtime_reference import train_reference
from test_dropin import TiedHead  # the output layer reusing the embedding's weight

VOCAB, DIM, SEQ, BATCH, CHUNKS, TIMEOUT = 11, 8, 6, 8, 2, 20.0


class Mix(nn.Module):
    """A layer with a non-persistent buffer (not in `state_dict()`) and a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("inv_freq", torch.linspace(0.5, 1.5, DIM), persistent=False)
        self.register_buffer("shift", torch.full((DIM,), 0.1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h) * self.inv_freq + self.shift)


def tied_lm() -> nn.Sequential:
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    return nn.Sequential(OrderedDict(embed=embed, mix=Mix(), head=TiedHead(embed)))


def lm_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((x, (x + 1) % VOCAB))
    return out


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def pipeline(**kwargs: Any) -> Pipeline:
    return Pipeline(tied_lm(), lm_loss, sgd, schedule="1f1b", chunks=CHUNKS, balance=[2, 1],
                    timeout=TIMEOUT, **kwargs)


def error_of(make: Callable[[], Any]) -> str:
    """The error `make()` raises, or "no error" (closing what it made)."""
    try:
        made = make()
    except Exception as err:  # noqa: BLE001 - the message is what the tests check
        return f"{type(err).__name__}: {err}"
    if isinstance(made, Pipeline):
        made.close()
    return "no error"


def job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = Path(root) / "runs"
    pipe = pipeline(checkpoint_dir=runs, checkpoint_every=2, checkpoint_keep=2)
    list(pipe.train(lm_batches(4), steps=4))  # saves runs/step-2 and runs/step-4
    out["state"] = pipe.state_dict()
    pipe.save(Path(root) / "ck")
    pipe.save(Path(root) / "ck")  # over an existing checkpoint: swapped in
    out["empty"] = error_of(lambda: pipe.save(Path(root) / "empty"))  # an empty folder: fine
    out["userdir"] = error_of(lambda: pipe.save(Path(root) / "userdir"))
    pipe.close()
    out["second_run"] = error_of(lambda: pipeline(checkpoint_dir=runs, checkpoint_every=2))
    out["file_dir"] = error_of(lambda: pipeline(checkpoint_dir=Path(root) / "afile",
                                                checkpoint_every=2))
    resumed = Pipeline.load(runs, tied_lm(), lm_loss, sgd, schedule="1f1b", chunks=CHUNKS,
                            timeout=TIMEOUT, checkpoint_dir=runs, checkpoint_every=2,
                            checkpoint_keep=2)
    list(resumed.train(lm_batches(6)[4:], steps=2))  # saves runs/step-6, prunes step-2
    resumed.close()
    return out


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("safety")
    (root / "userdir" / "sub").mkdir(parents=True)
    (root / "userdir" / "important.txt").write_text("mine")
    (root / "userdir" / "sub" / "data.bin").write_bytes(b"\x01\x02")
    (root / "empty").mkdir()
    (root / "afile").write_text("not a folder")
    return root, launch(job, 2, str(root), timeout=240)


def outputs(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a fresh model loaded strictly with `state` computes."""
    model = tied_lm()
    model.load_state_dict(state, strict=True)
    return model(lm_batches(1)[0][0])


def reference_outputs(steps: int) -> torch.Tensor:
    return outputs(train_reference(tied_lm(), lm_batches(steps), CHUNKS, lm_loss, sgd))


# --- A: the model's own state_dict() keys, loaded strictly -----------------------------------

def test_state_dict_and_export_load_strictly_into_a_fresh_model(done):
    root, results = done
    keys = set(tied_lm().state_dict())
    assert keys == {"embed.weight", "mix.linear.weight", "mix.linear.bias", "mix.shift",
                    "head.weight"}
    for state, steps in ((results[0]["state"], 4), (ckpt.export(root / "ck"), 4),
                         (ckpt.export(root / "runs"), 6)):  # step-6: saved by the resumed run
        assert set(state) == keys  # the tied head is there, the non-persistent buffer is not
        assert state["head.weight"] is state["embed.weight"]  # one tensor, as in state_dict()
        torch.testing.assert_close(outputs(state), reference_outputs(steps), atol=1e-5,
                                   rtol=1e-4)
    assert torch.equal(outputs(ckpt.export(root / "ck")), outputs(results[0]["state"]))


# --- B: safetensors ---------------------------------------------------------------------------

def test_export_to_safetensors_loads_strictly_with_load_model(done, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_model
    root, _ = done
    out = tmp_path / "model.safetensors"
    assert main(["export", str(root / "ck"), "--out", str(out)]) == 0
    assert "safetensors" in capsys.readouterr().out
    model = tied_lm()
    missing, unexpected = load_model(model, out)  # strict=True: raises on any key mismatch
    assert not missing and not unexpected
    assert model.head.weight is model.embed.weight  # still tied after loading
    torch.testing.assert_close(model(lm_batches(1)[0][0]), reference_outputs(4), atol=1e-5,
                               rtol=1e-4)
    with safe_open(out, "pt") as f:  # the shared tensor once, its alias in the metadata
        assert sorted(f.keys()) == ["embed.weight", "mix.linear.bias", "mix.linear.weight",
                                    "mix.shift"]
        assert f.metadata() == {"format": "pt", "head.weight": "embed.weight"}
    pt = tmp_path / "model.bin"  # any other suffix: torch.save, or --format says which
    assert main(["export", str(root / "ck"), "--out", str(pt), "--format", "torch"]) == 0
    assert torch.equal(outputs(torch.load(pt, weights_only=True)), model(lm_batches(1)[0][0]))


# --- C: export never destroys its input nor leaves litter -------------------------------------

def copied(done: tuple[Path, Any], tmp_path: Path, name: str = "ck") -> Path:
    folder = tmp_path / name
    shutil.copytree(done[0] / "ck", folder)
    return folder


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and match in err, err


def test_export_refuses_to_write_inside_the_checkpoint_it_reads(done, tmp_path, capsys):
    folder = copied(done, tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    one_line_error(["export", str(folder), "--out", str(folder / "stage0.pt")], capsys,
                   "inside the checkpoint")
    one_line_error(["export", str(folder), "--out", str(folder / "model.pt")], capsys,
                   "inside the checkpoint")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert ckpt.export(folder)  # still whole


def test_export_to_a_directory_or_a_missing_folder_is_one_line_and_leaves_nothing(
        done, tmp_path, capsys):
    folder = copied(done, tmp_path)
    (tmp_path / "outdir").mkdir()
    one_line_error(["export", str(folder), "--out", str(tmp_path / "outdir")], capsys,
                   "is a directory")
    one_line_error(["export", str(folder), "--out", str(tmp_path / "no" / "such" / "m.pt")],
                   capsys, "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "outdir"]
    assert not list((tmp_path / "outdir").iterdir())
    assert not list(tmp_path.rglob("*.tmp"))


# --- D: the manifest is untrusted input ------------------------------------------------------

def forge(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    change(manifest)
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))


def point_stage0_at_stage1(m: dict[str, Any]) -> None:
    m["files"]["0"] = dict(m["files"]["1"])  # checksum and size match stage1.pt


def stage0_at(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["files"]["0"].update(file=name)


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "files not a dict": (lambda m: m.update(files=["stage0.pt"]), "'files' must be"),
    "no bytes": (lambda m: m["files"]["0"].pop("bytes"), "'bytes'"),
    "no sha256": (lambda m: m["files"]["1"].pop("sha256"), "'sha256'"),
    "step abc": (lambda m: m.update(step="abc"), "'step' must be"),
    "negative epoch": (lambda m: m.update(epoch=-1), "'epoch' must be"),
    "stage not a number": (lambda m: m["files"].update(x=m["files"].pop("1")), "stage"),
    "a parent path": (stage0_at("../ck/stage0.pt"), "plain file name"),
    "an absolute path": (stage0_at("/etc/passwd"), "plain file name"),
    "a dot-dot": (stage0_at(".."), "plain file name"),
    "a sub-folder": (stage0_at("sub/stage0.pt"), "plain file name"),
    "one file twice": (lambda m: m["files"]["0"].update(file="stage1.pt"), "twice"),
    "stage 0 pointed at stage1.pt": (point_stage0_at_stage1, "twice"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_a_forged_manifest_is_refused_in_one_line(done, tmp_path, case):
    folder = copied(done, tmp_path)
    change, match = FORGERIES[case]
    forge(folder, change)
    with pytest.raises(ckpt.CheckpointError, match=match) as caught:
        ckpt.export(folder)
    assert "\n" not in str(caught.value)


def test_a_stage_file_renamed_into_another_stages_place_is_refused(done, tmp_path):
    """Even when the names and checksums are forged consistently: the file says its stage."""
    folder = copied(done, tmp_path)
    (folder / "stage0.pt").rename(folder / "keep.pt")
    (folder / "stage1.pt").rename(folder / "stage0.pt")
    (folder / "keep.pt").rename(folder / "stage1.pt")

    def swap(m: dict[str, Any]) -> None:
        m["files"]["0"], m["files"]["1"] = ({**m["files"]["1"], "file": "stage0.pt"},
                                            {**m["files"]["0"], "file": "stage1.pt"})
    forge(folder, swap)
    with pytest.raises(ckpt.CheckpointError, match=r"stage0\.pt holds stage 1"):
        ckpt.export(folder)


def test_a_stage_file_with_keys_of_another_stage_or_model_is_refused_at_load(done):
    """`Pipeline.load` restores each stage from its file by the model's own keys, and wants
    exactly those (here: the `mix` stage offered the whole model's state)."""
    from pipedream_fast.training import original_names
    model = tied_lm()
    with pytest.raises(ckpt.CheckpointError, match=r"holds 'embed\.weight' \(and 1 more"):
        ckpt.restore(model.mix, original_names(model), ckpt.export(done[0] / "ck"), "file.pt")
    ckpt.restore(model, original_names(model), ckpt.export(done[0] / "ck"), "file.pt")
    torch.testing.assert_close(model(lm_batches(1)[0][0]), reference_outputs(4), atol=1e-5,
                               rtol=1e-4)


def as_previous_format(folder: Path) -> None:
    """Rewrites a checkpoint as the previous format wrote it: no run id nor stage tags, a
    tied weight under one key, non-persistent buffers saved."""
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    for stage, entry in manifest["files"].items():
        path = folder / entry["file"]
        payload = torch.load(path, weights_only=True)
        del payload["stage"]
        payload["model"].pop("head.weight")
        if stage == "0":
            payload["model"]["mix.inv_freq"] = Mix().inv_freq
        torch.save(payload, path)
        entry.update(bytes=path.stat().st_size, sha256=ckpt.sha256(path))
    for key in ("run", "aliases"):
        del manifest[key]
    manifest["format"] = ckpt.LEGACY
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_previous_format_still_exports_and_restores(done, tmp_path):
    from pipedream_fast.training import original_names
    folder = copied(done, tmp_path)
    as_previous_format(folder)
    state = ckpt.export(folder)  # as it was saved: loads with strict=False
    assert set(state) == {"embed.weight", "mix.linear.weight", "mix.linear.bias",
                          "mix.shift", "mix.inv_freq"}
    model = tied_lm()  # what Pipeline.load does: each tensor from one of its keys
    ckpt.restore(model, original_names(model), state, str(folder), exact=False)
    torch.testing.assert_close(model(lm_batches(1)[0][0]), reference_outputs(4), atol=1e-5,
                               rtol=1e-4)


# --- E: a save writes only into a folder it owns ---------------------------------------------

def test_a_save_into_a_users_folder_is_refused_and_deletes_nothing(done):
    root, results = done
    for rank in results:
        assert "important.txt" in rank["userdir"] and "not a checkpoint" in rank["userdir"]
    assert (root / "userdir" / "important.txt").read_text() == "mine"
    assert (root / "userdir" / "sub" / "data.bin").read_bytes() == b"\x01\x02"
    assert not (root / "userdir.partial").exists()
    assert results[0]["empty"] == "no error" and (root / "empty" / ckpt.MANIFEST).exists()
    assert sorted(p.name for p in (root / "ck").iterdir()) == [ckpt.MANIFEST, "stage0.pt",
                                                               "stage1.pt"]


# --- F: one run per checkpoint_dir -----------------------------------------------------------

def run_of(folder: Path) -> str:
    return str(json.loads((folder / ckpt.MANIFEST).read_text())["run"])


def test_a_second_run_in_a_checkpoint_dir_is_refused_at_construction(done):
    root, results = done
    first = run_of(root / "runs" / "step-4")
    for rank in results:
        assert first in rank["second_run"] and "Pipeline.load" in rank["second_run"]
        assert "afile" in rank["file_dir"] and "not a folder" in rank["file_dir"]


def test_a_resumed_run_keeps_its_id_and_prunes_only_its_own(done):
    root, _ = done
    runs = root / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["step-4", "step-6"]  # keep 2
    assert run_of(runs / "step-6") == run_of(runs / "step-4")
    assert len(run_of(runs / "step-4")) == 32  # a uuid


def test_pruning_removes_only_this_runs_checkpoints(done, tmp_path):
    root, _ = done
    runs = tmp_path / "runs"
    shutil.copytree(root / "runs", runs)
    other = runs / "step-1"
    shutil.copytree(runs / "step-4", other)
    forge(other, lambda m: m.update(run="0" * 32))
    ckpt.prune(runs, 1, run_of(runs / "step-4"))
    assert sorted(p.name for p in runs.iterdir()) == ["step-1", "step-6"]


def test_a_folder_of_two_runs_is_not_guessed_at(done, tmp_path):
    root, _ = done
    runs = tmp_path / "runs"
    shutil.copytree(root / "runs", runs)
    other = runs / "step-9"
    shutil.copytree(runs / "step-4", other)
    forge(other, lambda m: m.update(run="0" * 32))
    with pytest.raises(ckpt.CheckpointError, match="2 runs") as caught:
        ckpt.export(runs)
    assert "0" * 32 in str(caught.value) and run_of(runs / "step-6") in str(caught.value)
    assert ckpt.export(other)  # one checkpoint, named: fine


def test_a_complete_checkpoint_never_swapped_in_is_noted(tmp_path):
    """Rank 0 killed between writing the staged save's manifest and the swap: `ck.partial`
    is complete and newer than `ck`; loading `ck` says so (issue 35, item 8)."""
    named = tmp_path / "ck"
    named.mkdir()
    (named / ckpt.MANIFEST).write_text("{}")
    partial = ckpt.staging(named)
    shutil.copytree(named, partial)
    folder, notes = ckpt.resolve(named)
    assert folder == named
    assert notes == [f"{partial} holds a newer complete checkpoint that was never swapped in "
                     f"(the save was cut just before); loading {named}, the one named: pass "
                     f"{partial} to load the newer one"]
