"""The bundled DSpark draft from a ``ds4tools distill --kind dspark`` run.

``ds4tools distill`` (ds4tools/distill, docs/distill.md) trains the draft on the engine's own
features of the demo target and keeps its run directory (``--resume DIR``): ``run.json`` (the
options), ``checkpoint.pt`` (the float32 weights). Its torch module (ds4tools/distill/model.py,
``DSparkDraft``) computes the same function as this folder's DeepSpec-style ``DSparkDraft``
(model.py): fc over the target features concatenated in ``target_layers`` order, hidden_norm,
decoder layers whose context K/V come from those rows without the layer's input norm,
anchor-first blocks at positions a..a+B-1, the final norm, the vanilla Markov head
``markov_w2(markov_w1[prev])`` and the confidence head over ``[hid ; markov_w1[prev]]``. Only the
names differ (llama.cpp's per-layer names there, Hugging Face / DeepSpec names here), so the
export is a renaming, then the shipped f16 rounding.

    # the draft of a finished run into the bundle, then the card's figures measured again:
    python tools/demo/import_distilled.py RUN_DIR --report OUT.distill.json
    python tools/demo/import_distilled.py --card-only     # README.md again from metrics.json

``tools/train_demo.py`` runs ``ds4tools distill`` itself (``distill_draft``) and imports its
run the same way.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__" and not __package__:  # run as a script: import as tools/demo's module
    import importlib
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    importlib.import_module("demo")
    __package__ = "demo"

from ds4tools.support.hf_dspark import LAYER_NAMES  # llama.cpp's per-layer names -> DeepSpec's

from .common import Log, Plan, read_json, round_to_shipped_, write_json
from .corpus import MASK, SPECIALS
from .model import DraftShape, DSparkDraft, TargetShape

#: distill's tensors outside the layers (its names are llama.cpp's per-layer ones within them,
#: as the converter's LAYER_NAMES reads them) -> DeepSpec's
TOP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "conf_proj.weight": "confidence_head.proj.weight",
    "conf_proj.bias": "confidence_head.proj.bias",
}


def deepspec_name(name: str) -> str:
    """The DeepSpec name of one of distill's DSpark tensors."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise ValueError(f"{name}: not a tensor of a ds4tools distill DSpark draft")


def read_run(run_dir: Path) -> tuple[dict, dict, DraftShape]:
    """(run.json's identity, the checkpoint's float32 state dict, the draft's shape) of a
    finished ``ds4tools distill --kind dspark`` run directory."""
    run_dir = Path(run_dir)
    ident = read_json(run_dir / "run.json")["identity"]
    if ident.get("kind") != "dspark":
        raise ValueError(f"{run_dir}: a {ident.get('kind')} run, not a DSpark one")
    ck = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    st = ck["state"]
    if st["total"] is None or st["step"] < st["total"]:
        raise ValueError(f"{run_dir}: training stopped at step {st['step']} of {st['total']}; "
                         "finish the run first (rerun the same command)")
    if ident.get("mask_token") != SPECIALS.index(MASK):
        raise ValueError(f"{run_dir}: mask token {ident.get('mask_token')}, the demo's is "
                         f"{SPECIALS.index(MASK)} ({MASK})")
    state = {k: v.detach().float() for k, v in ck["model"].items()}
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    shape = DraftShape(block_size=int(ident["block_size"]),
                       target_layer_ids=tuple(int(i) for i in ident["target_layers"]),
                       num_draft_layers=n_layers, markov_rank=int(ident["markov_rank"]))
    return ident, state, shape


def deepspec_draft(state: dict, shape: DraftShape) -> DSparkDraft:
    """This folder's DSparkDraft holding distill's weights (float32), every tensor checked
    against the module's names and shapes."""
    draft = DSparkDraft(TargetShape(), shape)
    want = draft.state_dict()
    renamed = {deepspec_name(k): v for k, v in state.items()}
    missing, extra = sorted(set(want) - set(renamed)), sorted(set(renamed) - set(want))
    if missing or extra:
        raise ValueError(f"the run's tensors do not fill the draft: missing {missing}, extra {extra}")
    for k, v in renamed.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"{k}: shape {tuple(v.shape)}, the draft's is {tuple(want[k].shape)}")
    draft.load_state_dict(renamed)
    draft.eval()
    return draft


def shipped_draft(run_dir: Path) -> tuple[DSparkDraft, dict]:
    """The run's draft rounded to the shipped f16 values (kept float32), and run.json's identity."""
    ident, state, shape = read_run(run_dir)
    draft = deepspec_draft(state, shape)
    round_to_shipped_(draft)
    return draft, ident


def write_bundle_draft(draft: DSparkDraft, out: Path, num_anchors: int) -> None:
    """``out/model.safetensors`` (f16, DeepSpec names) and ``out/config.json`` of the draft."""
    from .export import _shipped, _write_safetensors, _write_text, dspark_config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out / "model.safetensors", _shipped(draft.state_dict()))
    cfg = dspark_config(TargetShape(), draft.dshape, num_anchors)
    _write_text(out / "config.json", json.dumps(cfg, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# What the card says about the run (metrics.json "dspark"), from distill's JSON report


def distill_command(plan: Plan, target: str, out: str, data: str, prompts: str, resume: str) -> list[str]:
    """The ``ds4tools distill`` arguments of the demo's draft (docs/distill.md, "The 30-minute
    runs"), with ``--steps`` for its ``--time 30m``: the step count that run fixed, so the
    schedule and every step's batch are the same."""
    cmd = ["distill", target, "--kind", "dspark", "-o", out, "--data", data, "--include", "*.py"]
    for name in ("test", "tests", "idle_test", "site-packages"):
        cmd += ["--exclude", name]
    cmd += ["--target-layers", plan.ds_target_layers, "--windows", str(plan.ds_windows),
            "--lr", f"{plan.ds_lr:g}", "--steps", str(plan.ds_steps), "--threads", str(plan.ds_threads),
            "--eval-anchors", str(plan.ds_eval_anchors), "--eval-tokens", str(plan.ds_eval_tokens),
            "--eval-prompts", prompts, "--resume", resume]
    return cmd


#: the command as docs/distill.md gives it ("The 30-minute runs"), for the card
DOCUMENTED_COMMAND = """\
ds4tools distill "$DEMO" --kind dspark -o dspark-30m.gguf --data "$STD" --include '*.py' \\
    --exclude test --exclude tests --exclude idle_test --exclude site-packages \\
    --windows 2048 --lr 6e-3 --time 30m --threads 2 --eval-anchors 10000 \\
    --eval-prompts ds4tools/data/demo/prompts.json --resume runs/distill-dspark-30m"""

HISTORY_COLUMNS = ["step", "lr", "loss", "l1"] + [f"accept@{k}" for k in range(8)] + \
    [f"top1@{k}" for k in range(8)]


def distill_metrics(report: dict, command: str) -> dict:
    """metrics.json's "dspark" section from distill's JSON report (OUT.distill.json)."""
    o, tr, data, draft = report["options"], report["training"], report["data"], report["draft"]
    hist = [[h["step"], round(h["lr"], 7), h["loss"], h["l1"], *[round(a, 4) for a in h["accept"]],
             *[round(a, 4) for a in h["top1"]]] for h in tr["history"]]
    ev = report["evaluation"]
    opts = {k: o[k] for k in ("include", "exclude", "windows", "lr", "steps", "time_s", "threads",
                              "seed", "anchors", "rollouts", "self_generate", "markov_rank",
                              "precision", "type", "eval_anchors", "eval_tokens")}
    from ds4tools.distill.dspark import CE_W, CONF_W, DECAY_GAMMA, L1_W
    from ds4tools.distill.options import DEFAULTS
    defaults = DEFAULTS["dspark"]
    return {
        "trainer": "ds4tools distill --kind dspark",
        "command": command,
        "target": "the demo target as ds4tools ships it: target/ converted to a Q8_0 GGUF "
                  "(ds4tools.demo.demo_model_path)",
        "options": opts,
        "resolved": {"batch_windows": o["batch"] or defaults["batch"], "blocks_per_window": o["anchors"],
                     "warmup_steps": min(defaults["warmup"], max(1, tr["total_steps"] // 10)),
                     "lr_schedule": "linear warm-up, then cosine to 5% of the peak",
                     "optimizer": "AdamW (0.9, 0.95), no weight decay, grad clip 1",
                     "seq_len": data["seq_len"]},
        "draft": draft,
        "parameters_trainable": draft["parameters"],
        "data": {k: data[k] for k in ("files", "heldout_files", "bytes_read", "heldout_split",
                                      "train_tokens", "heldout_tokens", "seq_len", "text_windows",
                                      "self_generated_windows", "rollouts_per_text_window",
                                      "feature_dtype", "features_seconds")},
        "steps": tr["steps"],
        "train_s": tr["train_seconds"],
        "run_s_before_evaluation": tr["run_seconds_before_evaluation"],
        "evaluation_s": ev.get("seconds"),
        # the command's wall time: corpus, features, training and its own evaluation
        "wall_s": round(tr["run_seconds_before_evaluation"] + (ev.get("seconds") or 0.0), 1),
        "stopped_by": tr["stopped_by"],
        "loss": f"{CE_W}*CE + {L1_W}*L1(p_draft, p_target) + {CONF_W}*BCE(conf, 1 - L1/2), "
                f"weights exp(-k/{DECAY_GAMMA:g})",
        "final_ema": tr["final_ema"],
        "loss_history_columns": HISTORY_COLUMNS,
        "loss_history": hist,
        "engine_evaluation": {
            "heldout": {k: ev["heldout"][k] for k in ("protocol", "block", "dspark", "dspark_conf_cut_0.5",
                                                      "mean_proposal_conf_cut_0.5", "prompt_lookup")},
            "prompts": {k: ev["prompts"][k] for k in ("prompts", "tokens_per_prompt", "greedy", "t1",
                                                      "greedy_identical_to_plain")} if "prompts" in ev else None,
        },
    }


# --------------------------------------------------------------------------------------------
# tools/train_demo.py's DSpark stage: distill on the freshly trained target, then import


def distill_draft(plan: Plan, work: Path, log: Log) -> dict:
    """Run ``ds4tools distill`` on ``work``'s shipped target (converted to Q8_0 as the demo
    converts it) and write ``work/dspark_shipped.pt``; returns the metrics section. Resumable:
    the distill run directory is ``work/distill-dspark``."""
    from ds4tools.quantize import QuantizeOptions, quantize_model

    from .corpus import stdlib_root
    from .export import write_target_folder
    t0 = time.time()
    hf = work / "target_hf"
    gguf = work / "target-q8_0.gguf"
    if not gguf.exists():  # written to a temporary name and renamed by quantize_model
        write_target_folder(work, hf)
        quantize_model(hf, gguf, QuantizeOptions("Q8_0", progress=False, overwrite=True), report=lambda m: None)
    out = work / "dspark-distill.gguf"
    args = distill_command(plan, str(gguf), str(out), str(stdlib_root()), str(work / "prompts.json"),
                           str(work / "distill-dspark"))
    if not out.exists():
        log("dspark: ds4tools " + " ".join(args[:2]) + " ... (docs/distill.md)")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ds4tools.cli", *args], check=True, env=env)
    report = read_json(out.with_name(out.stem + ".distill.json"))
    draft, _ = shipped_draft(work / "distill-dspark")
    if draft.dshape != DraftShape():  # what evaluate.load_shipped and the export build
        raise ValueError(f"the distilled draft's shape {draft.dshape} is not model.DraftShape()'s")
    torch.save(draft.state_dict(), work / "dspark_shipped.pt")
    metrics = distill_metrics(report, DOCUMENTED_COMMAND)
    metrics["command_run"] = "ds4tools " + " ".join(a if " " not in a and "*" not in a else repr(a) for a in args)
    metrics["stage_wall_s"] = round(time.time() - t0, 1)
    log(f"dspark: {report['training']['steps']} steps of ds4tools distill, engine held-out tau "
        f"{report['evaluation']['heldout']['dspark']['tau']:.3f}")
    return metrics


# --------------------------------------------------------------------------------------------
# Replacing the draft of an existing bundle (its target and MTP layer unchanged)


def work_from_bundle(demo: Path, work: Path) -> None:
    """A tools/train_demo.py work folder rebuilt from the bundle: the shipped target, the
    tokenizer, the prompts and the held-out files tokenized as the corpus stage tokenizes them
    (each followed by <|endoftext|>), for evaluate.py and reference.py."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from .corpus import encode_files, stdlib_root
    work.mkdir(parents=True, exist_ok=True)
    state = {k: v.float() for k, v in load_file(str(demo / "target" / "model.safetensors")).items()}
    torch.save(state, work / "target_shipped.pt")
    tok = Tokenizer.from_file(str(demo / "target" / "tokenizer.json"))
    tok.save(str(work / "tokenizer.json"))
    for name in ("heldout_files.txt", "prompts.json"):
        (work / name).write_bytes((demo / name).read_bytes())
    heldout = (demo / "heldout_files.txt").read_text().splitlines()
    arrays = encode_files(tok, stdlib_root(), heldout)
    np.savez(work / "heldout_tokens.npz", **{f"f{i:03d}": a for i, a in enumerate(arrays)})


DSPARK_EVAL_KEYS = ("dspark", "dspark_conf_cut_0.5", "mean_proposal_len_conf_cut_0.5", "prompt_lookup",
                    "dspark_raw_match_per_position")


def replace_draft(run_dir: Path, report_path: Path, demo: Path, work: Path, log: Log,
                  command: str = DOCUMENTED_COMMAND, llama_server_check: dict | None = None) -> dict:
    """Put the run's draft into ``demo`` and measure it as the card measures; the target's and
    MTP layer's figures stay as they are (they are measured again only to check that the
    rebuilt work folder is the one the card was made from)."""
    from tokenizers import Tokenizer

    from .evaluate import evaluate, load_shipped
    from .reference import build_reference
    from .model import count_parameters

    metrics = read_json(demo / "metrics.json")
    # the bundle's plan for the target, the MTP layer and the evaluation; this one's for the draft
    plan = Plan(**{k: v for k, v in metrics["plan"].items()
                   if k in Plan.__dataclass_fields__ and not k.startswith("ds_")})
    report = read_json(report_path)
    draft, ident = shipped_draft(run_dir)
    data = report["data"]
    if (data["heldout_files"], data["heldout_tokens"]) != (metrics["corpus"]["heldout_count"],
                                                           metrics["tokenizer"]["heldout_tokens"]):
        raise ValueError(f"{report_path}: {data['heldout_files']} held-out files, {data['heldout_tokens']} "
                         "tokens: not the bundle's held-out split")
    work_from_bundle(demo, work)
    torch.save(draft.state_dict(), work / "dspark_shipped.pt")
    log(f"import: {run_dir} -> {demo / 'dspark'} (target layers {list(draft.dshape.target_layer_ids)})")
    write_bundle_draft(draft, demo / "dspark", report["options"]["anchors"])

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    prompts = [np.array(tok.encode(p["text"], add_special_tokens=False).ids)
               for p in read_json(work / "prompts.json")]
    torch.manual_seed(plan.seed + 4)
    ev = evaluate(plan, work, log, prompts)
    old = metrics["eval"]
    same = {"target_heldout_loss": (ev["target_heldout_loss"], old["target_heldout_loss"]),
            "mtp_heldout": (ev["mtp_heldout"], old["mtp_heldout"]),
            "generated_t1 prompt lookup": (ev["generated_t1"]["prompt_lookup"]["tau"],
                                           old["generated_t1"]["prompt_lookup"]["tau"])}
    for what, (now, before) in same.items():
        if now != before:
            log(f"import: WARNING {what} measured {now}, the card says {before}: the rebuilt work "
                "folder differs from the training run's")
    previous = {"trained_by": "tools/train_demo.py's own torch loop on self-distilled target rollouts"
                if "dspark_data" in metrics else metrics["dspark"].get("trainer", "?"),
                "target_layer_ids": metrics["draft_shape"]["target_layer_ids"],
                "heldout_tau": old["heldout_text"]["dspark"]["tau"]}
    for ctx in ("heldout_text", "generated_greedy", "generated_t1"):
        for k in DSPARK_EVAL_KEYS:
            old[ctx][k] = ev[ctx][k]
    metrics["dspark"] = distill_metrics(report, command)
    if previous["target_layer_ids"] != list(draft.dshape.target_layer_ids):
        metrics["dspark"]["previous_draft"] = previous
    if llama_server_check:
        metrics["dspark"]["llama_server_check"] = llama_server_check
    metrics.pop("dspark_data", None)
    metrics["draft_shape"] = {**draft.dshape.__dict__, "target_layer_ids": list(draft.dshape.target_layer_ids)}
    metrics["plan"] = plan.as_dict()
    times = metrics["timings"]
    times.pop("dspark_data_s", None)
    bench = metrics.get("step_times_uncontended")
    if bench:
        for k in ("dspark_data", "dspark"):
            bench.pop(k, None)
        # as tools/train_demo.py estimates it
        long_steps = plan.target_steps - math.ceil(plan.target_long_from * plan.target_steps)
        per = {k: v["seconds_per_step"] for k, v in bench.items()}
        est = (times["corpus_s"] + (plan.target_steps - long_steps) * per["target"]
               + long_steps * per.get("target_long", per["target"]) + plan.mtp_steps * per["mtp"]
               + metrics["dspark"]["wall_s"] + metrics["eval"]["wall_s"])
        times["estimated_uncontended_s"] = round(est, 1)
    times["total_wall_s"] = round(times["corpus_s"] + metrics["target"]["wall_s"] + metrics["mtp"]["wall_s"]
                                  + metrics["dspark"]["wall_s"] + metrics["eval"]["wall_s"], 1)

    target, draft = load_shipped(work)
    write_json(demo / "reference.json", build_reference(target, draft, prompts))
    metrics["sizes"]["dspark_tensors"] = len(draft.state_dict())
    metrics["sizes"]["dspark_params"] = count_parameters(draft)
    return write_card(demo, metrics)


def write_card(demo: Path, metrics: dict | None = None) -> dict:
    """metrics.json (its file sizes measured again) and README.md generated from it."""
    from .card import make_card
    metrics = metrics or read_json(demo / "metrics.json")
    sizes = metrics["sizes"]
    for _ in range(3):  # the card's size column includes the card itself
        sizes["dspark_bytes"] = (demo / "dspark" / "model.safetensors").stat().st_size
        sizes["total_bytes"] = sum(f.stat().st_size for f in demo.rglob("*") if f.is_file())
        write_json(demo / "metrics.json", metrics)
        (demo / "README.md").write_text(make_card(metrics))
    return metrics


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, nargs="?",
                   help="the run directory of `ds4tools distill --kind dspark` (--resume DIR)")
    p.add_argument("--report", type=Path, help="its JSON report (OUT.distill.json)")
    p.add_argument("--card-only", action="store_true",
                   help="only generate README.md again from metrics.json (after editing card.py)")
    p.add_argument("--demo", type=Path, default=Path(__file__).resolve().parents[2] / "ds4tools" / "data" / "demo")
    p.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[2] / "runs" / "demo-import")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--llama-server-check", metavar="SAME/CHECKED",
                   help="the result of tools/llama_server_check.py on the GGUF this run wrote (prompts "
                        "whose greedy text was identical with and without it / prompts checked), for the card")
    args = p.parse_args(argv)
    if args.card_only:
        total = write_card(args.demo)["sizes"]["total_bytes"]
        print(f"import: wrote {args.demo / 'README.md'} ({total:,} bytes in {args.demo})")
        return 0 if total <= 12_000_000 else 1
    if args.run_dir is None or args.report is None:
        p.error("give RUN_DIR and --report (or --card-only)")
    check = None
    if args.llama_server_check:
        same, checked = (int(x) for x in args.llama_server_check.split("/"))
        check = {"command": "llama-server -m target.gguf -md dspark.gguf --spec-type draft-dspark",
                 "prompts": checked, "identical": same, "tool": "tools/llama_server_check.py",
                 "draft_file": "the GGUF `ds4tools distill` wrote: the same weights in Q8_0"}
    if args.threads:
        torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log = Log(args.work / "import.log")
    m = replace_draft(args.run_dir, args.report, args.demo, args.work, log, llama_server_check=check)
    total = m["sizes"]["total_bytes"]
    log(f"import: wrote {args.demo} ({total:,} bytes)")
    return 0 if total <= 12_000_000 else 1


if __name__ == "__main__":
    sys.exit(main())
