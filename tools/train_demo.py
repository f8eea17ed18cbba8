#!/usr/bin/env python
"""Train the bundled demo model and write ds4tools/data/demo/ (see that directory's README.md).

Stages (each resumable; finished stages are recorded in <workdir>/stages.json and skipped):
corpus + tokenizer -> target -> MTP layer -> DSpark draft (`ds4tools distill` on the target
converted to Q8_0, docs/distill.md; then tools/demo/import_distilled.py) -> evaluation -> export
(f16 safetensors, configs, tokenizer, model card).

    python tools/train_demo.py                 # full run, ~2 h on 2 idle cores
    python tools/train_demo.py --smoke         # tiny end-to-end run into runs/demo_smoke
    python tools/train_demo.py --bench         # per-step times (run on an idle machine)

Needs torch (the `train` extra); nothing else in ds4tools does.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, help="checkpoints and logs (default runs/demo or runs/demo_smoke)")
    p.add_argument("--out", type=Path, help="output directory (default ds4tools/data/demo; smoke: <workdir>/out)")
    p.add_argument("--smoke", action="store_true", help="tiny step counts, for checking the pipeline")
    p.add_argument("--bench", action="store_true", help="measure per-step times and exit")
    p.add_argument("--threads", default="auto",
                   help="torch threads: a number, or auto (default: 2, or 1 while other jobs load the CPUs)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("train_demo.py needs torch: pip install -e '.[train]'", file=sys.stderr)
        return 2
    from demo import corpus
    from demo.common import Log, Plan, read_json, round_to_shipped_, set_thread_policy, smoke_plan, write_json

    set_thread_policy(args.threads)
    plan = smoke_plan() if args.smoke else Plan()
    work = args.workdir or REPO / "runs" / ("demo_smoke" if args.smoke else "demo")
    out = args.out or (work / "out" if args.smoke else REPO / "ds4tools" / "data" / "demo")
    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "train.log")

    if args.bench:
        from demo.bench import bench
        result = bench(plan, log, 2 if args.threads == "auto" else int(args.threads))
        write_json(work / "step_times.json", result)
        return 0

    stages_path = work / "stages.json"
    stages = read_json(stages_path) if stages_path.exists() else {}
    # A finished stage must have run with this plan's settings for it (prefix = stage).
    old_plan = stages.get("plan", {})
    for key, value in plan.as_dict().items():
        if key in ("checkpoint_every", "log_every"):
            continue
        prefix = key.split("_")[0]
        stage = {"target": "target", "mtp": "mtp", "ds": "dspark", "eval": "eval", "seed": "corpus"}.get(prefix)
        if key in old_plan and old_plan[key] != value and stage in stages:
            print(f"{work}: stage {stage} finished with {key}={old_plan[key]}, plan now says {value}; "
                  "use another --workdir", file=sys.stderr)
            return 2
    stages["plan"] = plan.as_dict()

    def done(name: str, **info) -> None:
        stages[name] = info
        write_json(stages_path, stages)

    log(f"train_demo: workdir {work}, output {out}, plan {'smoke' if args.smoke else 'full'}")

    # 1. corpus, split, tokenizer, prompts
    if "corpus" not in stages:
        t0 = time.time()
        torch.manual_seed(plan.seed)
        root = corpus.stdlib_root()
        files = corpus.list_files(root)
        info = corpus.describe(root, files)
        train_files = [f for f in files if not corpus.is_heldout(f)]
        heldout_files = [f for f in files if corpus.is_heldout(f)]
        tok = corpus.train_tokenizer(root, train_files, 2048)
        tok.save(str(work / "tokenizer.json"))
        write_json(work / "tokenizer_config.json", corpus.tokenizer_config(1024))
        train_arrays = corpus.encode_files(tok, root, train_files)
        heldout_arrays = corpus.encode_files(tok, root, heldout_files)
        np.save(work / "train_tokens.npy", np.concatenate(train_arrays))
        np.savez(work / "heldout_tokens.npz", **{f"f{i:03d}": a for i, a in enumerate(heldout_arrays)})
        (work / "heldout_files.txt").write_text("".join(f + "\n" for f in heldout_files))
        prompts = corpus.build_prompts(tok, root, heldout_files)
        write_json(work / "prompts.json", prompts)
        train_tokens = int(sum(len(a) for a in train_arrays))
        heldout_tokens = int(sum(len(a) for a in heldout_arrays))
        train_bytes = info["total_bytes"] - info["heldout_bytes"]
        tok_info = {
            "vocab_size": tok.get_vocab_size(), "train_tokens": train_tokens, "heldout_tokens": heldout_tokens,
            "train_tokens_per_byte": round(train_tokens / train_bytes, 4),
            "heldout_tokens_per_byte": round(heldout_tokens / info["heldout_bytes"], 4),
        }
        log(f"corpus: {info['file_count']} files ({info['heldout_count']} held out), "
            f"{train_tokens:,} train tokens, {len(prompts)} prompts")
        done("corpus", corpus=info, tokenizer=tok_info, wall_s=round(time.time() - t0, 1))

    # 2. target
    if "target" not in stages:
        from demo.train_target import train_target
        from demo.model import Qwen3Target, TargetShape
        torch.manual_seed(plan.seed)
        t0 = time.time()
        metrics = train_target(plan, work, log)
        model = Qwen3Target(TargetShape())
        model.load_state_dict(torch.load(work / "target_final.pt"))
        round_to_shipped_(model)
        torch.save(model.state_dict(), work / "target_shipped.pt")
        done("target", metrics=metrics, session_wall_s=round(time.time() - t0, 1))

    # 3. MTP layer
    if "mtp" not in stages:
        from demo.train_mtp import train_mtp
        from demo.model import Qwen3Target, TargetShape
        torch.manual_seed(plan.seed + 1)
        metrics = train_mtp(plan, work, log)
        model = Qwen3Target(TargetShape())
        model.load_state_dict(torch.load(work / "target_shipped.pt"))
        model.mtp.load_state_dict(torch.load(work / "mtp_final.pt"))
        round_to_shipped_(model)
        torch.save(model.state_dict(), work / "target_shipped.pt")
        done("mtp", metrics=metrics)

    # 4. DSpark draft: `ds4tools distill` on the engine's features of the target (Q8_0), its
    # run directory imported under DeepSpec's names (work/dspark_shipped.pt)
    if "dspark" not in stages:
        from demo.import_distilled import distill_draft
        metrics = distill_draft(plan, work, log)
        done("dspark", metrics=metrics)

    # 5. evaluation
    prompts_text = read_json(work / "prompts.json")
    if "eval" not in stages:
        from tokenizers import Tokenizer
        from demo.evaluate import evaluate
        torch.manual_seed(plan.seed + 4)
        tok = Tokenizer.from_file(str(work / "tokenizer.json"))
        prompts = [np.array(tok.encode(p["text"], add_special_tokens=False).ids) for p in prompts_text]
        metrics = evaluate(plan, work, log, prompts)
        done("eval", metrics=metrics)

    # 6. export
    from tokenizers import Tokenizer
    from demo.card import make_card
    from demo.evaluate import load_shipped
    from demo.export import export
    from demo.model import DraftShape, TargetShape, count_parameters
    from demo.reference import build_reference

    target, draft = load_shipped(work)
    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    prompts = [np.array(tok.encode(p["text"], add_special_tokens=False).ids) for p in prompts_text]
    write_json(work / "reference.json", build_reference(target, draft, prompts))
    n_target_tensors = len(target.state_dict())
    metrics = {
        "corpus": stages["corpus"]["corpus"],
        "tokenizer": stages["corpus"]["tokenizer"],
        "target": stages["target"]["metrics"],
        "mtp": stages["mtp"]["metrics"],
        "dspark": stages["dspark"]["metrics"],
        "eval": stages["eval"]["metrics"],
        "plan": plan.as_dict(),
        "target_shape": TargetShape().as_dict(),
        "draft_shape": {**DraftShape().__dict__, "target_layer_ids": list(DraftShape().target_layer_ids)},
        "n_prompts": len(prompts_text),
        "timings": {
            "corpus_s": stages["corpus"]["wall_s"],
        },
    }
    if (work / "step_times.json").exists():
        bench = metrics["step_times_uncontended"] = read_json(work / "step_times.json")
        long_steps = plan.target_steps - math.ceil(plan.target_long_from * plan.target_steps)
        per = {k: v["seconds_per_step"] for k, v in bench.items()}
        # the DSpark stage: distill's own wall time (its run's clock)
        metrics["timings"]["estimated_uncontended_s"] = round(
            metrics["timings"]["corpus_s"]
            + (plan.target_steps - long_steps) * per["target"]
            + long_steps * per.get("target_long", per["target"])
            + plan.mtp_steps * per["mtp"] + metrics["dspark"]["wall_s"]
            + metrics["eval"]["wall_s"], 1)
    metrics["timings"]["total_wall_s"] = round(
        metrics["timings"]["corpus_s"] + metrics["target"]["wall_s"] + metrics["mtp"]["wall_s"]
        + metrics["dspark"]["wall_s"] + metrics["eval"]["wall_s"], 1)
    # Sizes: write once to measure, then again with the measured sizes in the card.
    for _ in range(3):
        sizes = {
            "target_tensors": n_target_tensors, "target_params": count_parameters(target),
            "dspark_tensors": len(draft.state_dict()), "dspark_params": count_parameters(draft),
        }
        if (out / "target" / "model.safetensors").exists():
            sizes.update({
                "target_bytes": (out / "target" / "model.safetensors").stat().st_size,
                "dspark_bytes": (out / "dspark" / "model.safetensors").stat().st_size,
                "tokenizer_bytes": (out / "target" / "tokenizer.json").stat().st_size,
                "total_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
            })
        else:
            sizes.update({"target_bytes": 0, "dspark_bytes": 0, "tokenizer_bytes": 0, "total_bytes": 0})
        metrics["sizes"] = sizes
        export(plan, work, out, make_card(metrics), metrics)
        import shutil
        shutil.copyfile(work / "reference.json", out / "reference.json")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"export: wrote {out} ({total:,} bytes)")
    if total > 12_000_000:
        log("export: WARNING the demo directory is over the 12 MB budget")
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
