"""The zoo's transformers through `Pipeline` on a CUDA GPU with NCCL, against a one-process loop.

Step 'zoo' of bench/gpu_check.sh. tests/zoo's nanoGPT, Llama, GPT-2, BERT (tiny, unedited,
`loss_fn=None`), split before the second layer, 1f1b, 2 microbatches, SGD, `--steps`
minibatches: every step's loss equals the one-process loop's with the same gradient
accumulation (within RTOL), and the tied embedding and head stay one weight. Layouts (see
`layouts_for`), each a job stopped after LAYOUT_TIMEOUT: one rank per GPU with 2+ GPUs; with
one, 1 rank with stages=1 (the check), then two ranks on cuda:0 (NCCL refuses: 'refused') and
on the default device (informational: rank 1 has no cuda:1); gloo with `--device cpu`. Models
whose packages are missing are skipped (nanoGPT then runs from tests/zoo/gpt.py alone).

    python bench/gpu_zoo.py [--device cuda] [--models nanogpt,llama,gpt2,bert] [--out FILE.md]

Exit status: 0 when every check layout matched the loop and one ran; 1 otherwise; 2: no device.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpu_pipeline import NCCL_REFUSAL, ROOT, cuda_device  # a sibling; puts ROOT on sys.path

import harness  # noqa: E402 - a sibling
from pipedream_fast.data_feed import to_device  # noqa: E402
from pipedream_fast.launch import launch  # noqa: E402
from pipedream_fast.training import model_loss, split_microbatches  # noqa: E402

if str(ROOT / "tests") not in sys.path:  # the zoo
    sys.path.insert(0, str(ROOT / "tests"))

MODELS = ("nanogpt", "llama", "gpt2", "bert")
SPLIT = {"nanogpt": "transformer.h.1", "llama": "model.layers.1", "gpt2": "transformer.h.1",
         "bert": "bert.encoder.layer.1"}
TIED = {"nanogpt": "transformer.wte.weight", "llama": "model.embed_tokens.weight",
        "gpt2": "transformer.wte.weight"}  # the embedding, one parameter with the head
CHUNKS = 2
LR, MOMENTUM = 0.01, 0.9
RTOL = {"cuda": 1e-4, "cpu": 1e-5}  # losses, relative; CUDA: other kernels' summation orders
TIED_TOL = 1e-6  # relative: the embedding and the head must be one weight on both ranks
TIMEOUT = 60.0  # s, every wait of the pipelines and collectives
PROBE_TIMEOUT = 20.0  # s, the same in the informational layout, whose job gets 3x this
LAYOUT_TIMEOUT = 120.0  # s, the most a check layout's job may take


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def load_zoo(models: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """The zoo's entries (.build(), .batches(steps, seed)) for `models`, and the models skipped
    with why. Without torchvision (the zoo declares its operators before transformers imports
    it) nanoGPT is loaded from tests/zoo/gpt.py alone, as the zoo builds it."""
    try:
        import zoo
        zoo.import_torchvision()
    except ImportError as err:
        return _nanogpt_alone(models, f"the zoo cannot be imported here ({err})")
    transformers = importlib.util.find_spec("transformers") is not None
    why = "transformers is not installed (GPU_CHECK_WHEELS)"
    return ({m: zoo.ZOO[m] for m in models if m == "nanogpt" or transformers},
            {m: why for m in models if m != "nanogpt" and not transformers})


def _nanogpt_alone(models: tuple[str, ...], why: str) -> tuple[dict[str, Any], dict[str, str]]:
    spec = importlib.util.spec_from_file_location("zoo_gpt_alone",
                                                  ROOT / "tests" / "zoo" / "gpt.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt  # dataclasses look their module up
    spec.loader.exec_module(gpt)
    vocab, seq, batch = 64, 16, 8  # tests/zoo's VOCAB, SEQ, BATCH

    def build() -> nn.Module:  # tests/zoo's nanogpt()
        torch.manual_seed(0)
        return gpt.GPT(gpt.GPTConfig(block_size=seq, vocab_size=vocab, n_layer=2, n_head=4,
                                     n_embd=32))

    def batches(steps: int, seed: int) -> list[Any]:  # tests/zoo's _lm_pairs
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]
        return [(x, x.roll(-1, 1)) for x in xs]

    entries = {"nanogpt": SimpleNamespace(build=build, batches=batches)}
    return ({} if "nanogpt" not in models else entries), {m: why for m in models if m != "nanogpt"}


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def numerics(device: torch.device) -> None:
    """No TF32: the loop and the pipeline must run the same float32 arithmetic."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def reference(entry: Any, steps: int, device: torch.device) -> list[float]:
    """Each minibatch in CHUNKS microbatches, gradients accumulated (each microbatch's loss /
    CHUNKS), one SGD step: what 1f1b with chunks=CHUNKS computes."""
    numerics(device)
    model = entry.build().to(device).train()
    opt = sgd(model.parameters())
    losses = []
    for item in entry.batches(steps, 1):
        opt.zero_grad()
        total = 0.0
        for mb in split_microbatches(to_device(item, device), CHUNKS):
            loss = model_loss(call(model, mb))
            (loss / CHUNKS).backward()
            total += float(loss.detach()) / CHUNKS
        opt.step()
        losses.append(total)
    return losses


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    device: str  # "cpu", "cuda:0", or "default" (Pipeline's choice: cuda:LOCAL_RANK)
    one_stage: bool = False
    informational: bool = False  # its failure is what the report is for, not a failed check
    what: str = ""


def rank_main(rank: int, world: int, layout: Layout, models: list[str], steps: int,
              timeout: float) -> dict[str, Any]:
    """Each model on a fresh process group of `layout`'s backend: a Pipeline trained for
    `steps` minibatches; its losses, step time and this rank's copy of the tied weight."""
    from pipedream_fast.pipeline import Pipeline

    entries, _ = load_zoo(tuple(models))
    cuda = layout.device != "cpu"
    device = None if layout.device == "default" else torch.device(layout.device)
    if cuda:
        # NCCL works on the current device. Pipeline's default is cuda:LOCAL_RANK: set it where
        # it exists, and leave a missing one (1 GPU, rank 1) for Pipeline to meet itself.
        index = device.index if device is not None else int(os.environ.get("LOCAL_RANK", rank))
        if index is not None and index < torch.cuda.device_count():
            torch.cuda.set_device(index)
    else:
        torch.set_num_threads(1)
    numerics(torch.device("cuda" if cuda else "cpu"))
    out: dict[str, Any] = {}
    for number, name in enumerate(models):
        began = time.perf_counter()
        try:
            harness.fresh_group(rank, world, number, "nccl" if cuda else "gloo", timeout)
            if cuda and layout.device != "default":
                # NCCL builds its communicator at the first collective: a refusal shows here
                dist.all_reduce(torch.ones(1, device=device))
                torch.cuda.synchronize()
            split: dict[str, Any] = ({"stages": 1} if layout.one_stage
                                     else {"split_points": [SPLIT[name]]})
            model = entries[name].build()
            tied = dict(model.named_parameters(remove_duplicate=False)).get(TIED.get(name, ""))
            pipe = Pipeline(model, loss_fn=None, optimizer=sgd, schedule="1f1b", chunks=CHUNKS,
                            timeout=timeout, device=device, **split)
            losses = []
            first = time.perf_counter()
            for step, loss in enumerate(pipe.train(entries[name].batches(steps, 1), steps=steps)):
                losses.append(float(loss) if loss is not None else None)
                if step == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    first = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
            held = {id(p) for m in pipe.stage_modules.values() for p in m.parameters()}
            result: dict[str, Any] = {
                "losses": losses, "device": str(pipe.device), "backend": dist.get_backend(),
                "setup_s": first - began,
                "step_s": (time.perf_counter() - first) / max(1, steps - 1)}
            if tied is not None and id(tied) in held:
                result["tied"] = tied.detach().to("cpu", copy=True)
            pipe.close()
            out[name] = result
        except Exception as err:  # noqa: BLE001 - reported in the table
            out[name] = {"error": harness.shorten(err, 300),
                         "traceback": traceback.format_exc()[-3000:]}
            if cuda and NCCL_REFUSAL.search(str(err)):
                # the same communicator would be refused for every model: stop here
                for rest in models[models.index(name) + 1:]:
                    out[rest] = {"error": "not run, as the first model: "
                                          + harness.shorten(err, 300)}
                break
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a refused NCCL group may not tear down cleanly
            pass
    return out


@dataclass
class Row:
    layout: str
    model: str
    outcome: str  # match | differs | failed | refused | skipped | failed (expected)
    loss_rel_diff: float | None = None
    tied_rel_diff: float | None = None
    note: str = ""
    timing: str = ""
    check: bool = True  # counts towards the result
    tracebacks: list[str] = field(default_factory=list)


def layouts_for(device: torch.device) -> list[Layout]:
    if device.type == "cpu":
        return [Layout("pipeline", 2, "cpu", what="2 rank processes, gloo, CPU")]
    if torch.cuda.device_count() >= 2:
        return [Layout("pipeline", 2, "default",
                       what="2 rank processes, NCCL, one GPU each (Pipeline's default device)")]
    # The check first: what one GPU allows; then what Pipeline does with two ranks there.
    return [Layout("one-rank", 1, "cuda:0", one_stage=True,
                   what="1 rank, NCCL, cuda:0, stages=1 (no cut: what one GPU allows)"),
            Layout("pipeline", 2, "cuda:0",
                   what="2 rank processes, NCCL, device='cuda:0' on both"),
            Layout("default-device", 2, "default", informational=True,
                   what="2 rank processes, NCCL, device left to Pipeline (cuda:LOCAL_RANK) "
                        "on 1 GPU")]


def run_layout(layout: Layout, models: list[str], steps: int, want: dict[str, list[float]],
               rtol: float) -> list[Row]:
    """The layout's job, its ranks stopped after its wall time (a rank stuck in C++, in NCCL's
    communicator set-up for one, only ends that way); an informational layout shows what
    Pipeline does there: one model says it."""
    timeout = PROBE_TIMEOUT if layout.informational else TIMEOUT
    wall = 3 * PROBE_TIMEOUT if layout.informational else LAYOUT_TIMEOUT
    models = models[:1] if layout.informational else models
    began = time.perf_counter()
    stop = threading.Event()
    timer = threading.Timer(wall, stop.set)
    timer.start()
    try:
        by_rank = launch(rank_main, layout.world, layout, models, steps, timeout,
                         timeout=timeout, threads_per_rank=None if layout.device != "cpu" else 1,
                         stop=stop)
    except Exception as err:  # noqa: BLE001 - a rank died: the whole layout failed
        harness.unless_stopped(err)
        outcome = "failed (expected)" if layout.informational else "failed"
        why = (f"stopped after {wall:g} s: " if stop.is_set() else "") + harness.shorten(err, 500)
        return [Row(layout.name, m, outcome, note=why, check=not layout.informational)
                for m in models]
    finally:
        timer.cancel()
    print(f"  {layout.name}: {time.perf_counter() - began:.1f} s", flush=True)
    rows = []
    for name in models:
        results = [r[name] for r in by_rank]
        errors = [f"rank {k}: {r['error']}" for k, r in enumerate(results) if "error" in r]
        if errors:
            if layout.device == "cuda:0" and layout.world > 1 and \
                    any(NCCL_REFUSAL.search(e) for e in errors):
                rows.append(Row(layout.name, name, "refused", note="NCCL refused two ranks on "
                                "one GPU: " + errors[0], check=False))
            elif layout.informational:
                rows.append(Row(layout.name, name, "failed (expected)", note="; ".join(errors),
                                check=False))
            else:
                rows.append(Row(layout.name, name, "failed", note="; ".join(errors),
                                tracebacks=[r.get("traceback", "") for r in results]))
            continue
        devices = ", ".join(r["device"] for r in results)
        note = (f"ran (not expected with one GPU): {devices}" if layout.informational
                else f"{results[-1]['backend']} on {devices}")
        losses = results[-1]["losses"]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want[name]))
        ok = len(losses) == len(want[name]) and diff <= rtol
        tied_diff = None
        if name in TIED and layout.world > 1:
            first, last = results[0].get("tied"), results[-1].get("tied")
            if first is None or last is None:
                ok = False
                note += "; the tied weight was not found on both ranks"
            else:
                tied_diff = float((first - last).abs().max()) / max(float(last.abs().max()),
                                                                     1e-12)
                ok = ok and tied_diff <= TIED_TOL
        timing = (f"set-up {max(r['setup_s'] for r in results):.1f} s, "
                  f"{max(r['step_s'] for r in results) * 1e3:.0f} ms/step")
        rows.append(Row(layout.name, name, "match" if ok else "differs", diff, tied_diff, note,
                        timing, check=not layout.informational))
    return rows


def write_report(args: argparse.Namespace, device: torch.device, layouts: list[Layout],
                 rows: list[Row], rtol: float, final: bool) -> bool:
    """The markdown report (to --out, and printed when `final`); whether the check passed."""
    checked = [r for r in rows if r.check]
    passed = bool(checked) and all(r.outcome == "match" for r in checked)
    lines = ["## The zoo's transformers through Pipeline, 1f1b, 2 stages: losses against the "
             "one-process loop", "", f"Command: `{harness.command()}`", "",
             f"Machine: {harness.device_line(device)}.", "",
             f"{args.steps} minibatches of 8 per model, {CHUNKS} microbatches, SGD lr {LR} "
             f"momentum {MOMENTUM}, split before the second layer; pass: every step's loss "
             f"within {rtol:g} (relative) of the loop on {device} with the same gradient "
             f"accumulation (no TF32), and the tied embedding and head identical on both ranks "
             f"(within {TIED_TOL:g}).", "",
             "Layouts: " + "; ".join(f"'{lay.name}' = {lay.what}" for lay in layouts) + ".", "",
             "| layout | model | outcome | max loss rel diff | tied drift | time | note |",
             "| --- | --- | --- | ---: | ---: | --- | --- |"]
    lines += [f"| {r.layout} | {r.model} | {r.outcome} | {harness.fmt(r.loss_rel_diff, '.1e', '')}"
              f" | {harness.fmt(r.tied_rel_diff, '.1e', '')} | {r.timing} | "
              f"{r.note.replace('|', '/')} |" for r in rows]
    lines += ["", f"Result: {'PASS' if passed else 'FAIL'}" if final else
              "Result: (incomplete: the run did not finish)"]
    report = "\n".join(lines) + "\n"
    if final:
        print("\n" + report, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default: NCCL) or cpu (gloo: to try the script anywhere)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, among {', '.join(MODELS)} (default all)")
    parser.add_argument("--steps", type=int, default=3, help="minibatches per model (default 3)")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; choose among {', '.join(MODELS)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first and the later steps are checked)")
    device = cuda_device("gpu_zoo", args.device)
    if device is None:
        return 2
    if device.type == "cuda" and not dist.is_nccl_available():
        print("gpu_zoo: this torch has no NCCL", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    print(f"gpu_zoo: {harness.device_line(device)}; {gpus} GPU(s)", flush=True)
    t0 = time.perf_counter()
    entries, skipped = load_zoo(models)
    ran = [m for m in models if m in entries]
    want = {m: reference(entries[m], args.steps, device) for m in ran}
    print(f"reference: {args.steps} steps of the one-process loop on {device}, {CHUNKS}-way "
          f"gradient accumulation, for {', '.join(ran) or 'no model'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    rtol = RTOL[device.type]
    rows = [Row("-", m, "skipped", note=why, check=False) for m, why in skipped.items()]
    layouts = layouts_for(device)
    for layout in layouts if ran else []:
        print(f"\n-- layout {layout.name}: {layout.what}", flush=True)
        mine = run_layout(layout, ran, args.steps, want, rtol)
        for row in mine:  # the table itself is printed at the end
            print(f"  {row.model:8s} {row.outcome} {row.timing}", flush=True)
            for tb in filter(None, row.tracebacks):
                print("    " + tb.rstrip().replace("\n", "\n    "), flush=True)
        rows += mine
        write_report(args, device, layouts, rows, rtol, final=False)  # kept if killed
    return 0 if write_report(args, device, layouts, rows, rtol, final=True) else 1


if __name__ == "__main__":
    sys.exit(main())
