"""Training loop of the large target: GPU (bf16 autocast) or CPU, wall-clock budgeted, resumable.

The run's plan (window length, tokens per step, learning rate, warmup, total steps) is fixed on the
first invocation and stored in ckpt.pt; later invocations continue the same cosine schedule and
draw the same batches (they depend only on seed and step). With --total-steps auto the total is
set once, during warmup of the first invocation, from --minutes and the measured step time.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from demo.common import Log, cosine_lr, save_atomic, step_rng, write_json
from demo.train_target import init_weights

from demo.model import TargetShape

from .model import LARGE_SHAPE, LargeTarget, size_arithmetic

LN2 = math.log(2)
EVAL_SEGMENT = 1024


def _defaults(args, device: str) -> dict:
    cuda = device == "cuda"
    pick = lambda v, g, c: v if v is not None else (g if cuda else c)  # noqa: E731
    return {
        "seq": pick(args.seq, 1024, 256),
        "batch_tokens": pick(args.batch_tokens, 262144, 2048),
        "micro_batch": pick(args.micro_batch, 64, 4),
        "lr": pick(args.lr, 1.5e-3, 1.5e-3),
        "eval_every_s": 60 * pick(args.eval_every_min, 2.0, 10.0),
        "ckpt_every_s": 60 * pick(args.ckpt_every_min, 3.0, 5.0),
        "eval_tokens": pick(args.eval_tokens, 0, 8192),  # 0 = all
        "reserve_s": pick(args.export_reserve_s, 45.0, 60.0),
    }


def load_data(data: Path):
    tokens = np.memmap(data / "train_tokens.bin", dtype=np.uint16, mode="r")
    npz = np.load(data / "heldout_tokens.npz")
    heldout = [npz[k] for k in sorted(npz.files)]
    info = json.loads((data / "heldout_bytes.json").read_text())
    assert len(info["files"]) == len(heldout)
    return tokens, heldout, info


def draw_batch(tokens: np.ndarray, seed: int, step: int, n: int, seq: int) -> torch.Tensor:
    starts = step_rng(seed, "large-target", step).integers(0, len(tokens) - seq - 1, size=n)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq + 1]) for s in starts]).astype(np.int64))


def eval_subset(heldout: list[np.ndarray], info: dict, max_tokens: int):
    """Held-out files in their fixed order until max_tokens (0: all) -> (arrays, tokens, bytes)."""
    arrays, toks, nbytes = [], 0, 0
    for a, f in zip(heldout, info["files"]):
        if max_tokens and toks >= max_tokens:
            break
        arrays.append(a)
        toks += len(a)
        nbytes += f["bytes"]
    return arrays, toks, nbytes


@torch.no_grad()
def heldout_eval(model: LargeTarget, arrays: list[np.ndarray], n_tokens: int, n_bytes: int,
                 device: str, autocast: bool, batch: int) -> dict:
    """Mean next-token NLL over all positions, each file scored in EVAL_SEGMENT windows from its start
    (as tools/demo/train_target.sequence_loss); bits/byte = nats * tokens / (bytes * ln 2)."""
    segs = []
    for a in arrays:
        for s in range(0, len(a) - 1, EVAL_SEGMENT):
            c = a[s:s + EVAL_SEGMENT + 1]
            if len(c) >= 2:
                segs.append(c)
    segs.sort(key=len)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for i in range(0, len(segs), batch):
        group = segs[i:i + batch]
        width = max(len(c) for c in group)
        ids = np.zeros((len(group), width), dtype=np.int64)
        tgt = np.full((len(group), width - 1), -100, dtype=np.int64)
        for j, c in enumerate(group):
            ids[j, :len(c)] = c
            tgt[j, :len(c) - 1] = c[1:]
        ids_t = torch.from_numpy(ids[:, :-1]).to(device)
        tgt_t = torch.from_numpy(tgt).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            h = model.trunk_forward(ids_t)
            logits = model.lm_head(h)
        total += F.cross_entropy(logits.float().flatten(0, 1), tgt_t.flatten(), ignore_index=-100,
                                 reduction="sum").double()
        count += int((tgt_t != -100).sum())
    model.train(was_training)
    nats = float(total) / max(count, 1)
    return {"loss": round(nats, 5), "bits_per_byte": round(nats * n_tokens / (n_bytes * LN2), 5),
            "scored_tokens": count, "file_tokens": n_tokens, "bytes": n_bytes, "files": len(arrays)}


def make_optimizer(params, lr: float, wd: float, fused: bool):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train(args, shape: TargetShape | None = None) -> dict:
    """shape: the model shape of a fresh run (default LARGE_SHAPE; tests train tiny ones); a resumed
    run always uses the shape stored in its checkpoint's plan."""
    t_start = time.time()
    budget_s = args.minutes * 60 if args.minutes else None
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "log.txt")
    d = _defaults(args, device)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokens, heldout, hinfo = load_data(args.data)
    ckpt_path = work / "ckpt.pt"
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path.exists() else None
    if ck is not None:
        shape = TargetShape(**ck["plan"]["shape"])
    shape = shape or LARGE_SHAPE
    model = LargeTarget(shape)
    if ck is None:
        init_weights(model, args.seed)
        total = None if args.total_steps == "auto" else int(args.total_steps)
        plan = {"seed": args.seed, "seq": d["seq"], "batch_tokens": d["batch_tokens"],
                "windows_per_step": max(1, d["batch_tokens"] // d["seq"]), "lr": d["lr"],
                "min_lr_frac": 0.1, "warmup": 30 if cuda else 10, "weight_decay": 0.1, "grad_clip": 1.0,
                "total_steps": total, "train_tokens_file": int(len(tokens)),
                "shape": shape.as_dict()}
        state = {"step": 0, "history": [], "heldout_history": [], "train_s": 0.0, "tokens_seen": 0,
                 "sessions": []}
    else:
        model.load_state_dict(ck["model"])
        plan, state = ck["plan"], ck["state"]
        if args.total_steps != "auto":
            want = int(args.total_steps)
            if want != plan["total_steps"]:
                if want < state["step"]:
                    raise SystemExit(f"--total-steps {want} is below the checkpoint's step {state['step']}")
                log(f"schedule: total steps changed {plan['total_steps']} -> {want} (the cosine is stretched)")
                plan["total_steps"] = want
        for key in ("seq", "batch_tokens", "lr"):
            given = getattr(args, key)
            if given is not None and given != plan[key]:
                log(f"note: --{key.replace('_', '-')} {given} ignored; the checkpoint's plan says {plan[key]}")
        if plan["train_tokens_file"] != len(tokens):
            raise SystemExit("train_tokens.bin differs from the one this checkpoint was trained on")
    model.to(device)
    params = model.trunk_parameters()
    opt = make_optimizer(params, plan["lr"], plan["weight_decay"], fused=cuda)
    if ck is not None:
        opt.load_state_dict(ck["opt"])
        if "torch_rng" in ck:
            torch.set_rng_state(ck["torch_rng"])
        log(f"resumed at step {state['step']} of {plan['total_steps']} ({state['tokens_seen']:,} tokens seen)")
    del ck
    fwd = torch.compile(model.trunk_forward) if args.compile else model.trunk_forward
    sizes = size_arithmetic(shape)
    seq, n_win, micro = plan["seq"], plan["windows_per_step"], d["micro_batch"]
    step_tokens = n_win * seq
    log(f"device {device}{' ' + torch.cuda.get_device_name() if cuda else f' ({torch.get_num_threads()} threads)'}, "
        f"torch {torch.__version__}; {sizes['parameters']:,} trunk parameters (Q8_0 {sizes['q8_0_bytes']:,} B); "
        f"{len(tokens):,} train tokens; {n_win}x{seq} tokens/step in micro-batches of {micro}; "
        f"lr {plan['lr']} warmup {plan['warmup']} total {plan['total_steps'] or 'auto'}; "
        f"budget {budget_s or 'none'} s (reserve {d['reserve_s']} s); startup {time.time() - t_start:.1f}s")

    ev_arrays, ev_tokens, ev_bytes = eval_subset(heldout, hinfo, d["eval_tokens"])
    ev_batch = 32 if cuda else 2

    def evaluate(tag: str, final: bool = False) -> dict:
        t0 = time.time()
        if final:  # what ships: weights rounded to bf16, scored in fp32
            m = copy.deepcopy(model)
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            r = heldout_eval(m, ev_arrays, ev_tokens, ev_bytes, device, autocast=False, batch=ev_batch)
            del m
        else:
            r = heldout_eval(model, ev_arrays, ev_tokens, ev_bytes, device, autocast=True, batch=ev_batch)
        r.update({"step": state["step"], "tag": tag, "eval_s": round(time.time() - t0, 1)})
        state["heldout_history"].append(r)
        log(f"eval ({tag}) step {state['step']}: held-out loss {r['loss']:.4f} nats/token, "
            f"{r['bits_per_byte']:.4f} bits/byte on {r['files']} files / {r['file_tokens']:,} tokens "
            f"({r['eval_s']}s)")
        return r

    def checkpoint() -> None:
        t0 = time.time()
        save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "plan": plan, "state": state,
                     "torch_rng": torch.get_rng_state()}, ckpt_path)
        log(f"checkpoint at step {state['step']} ({time.time() - t0:.1f}s)")

    session = {"device": device, "start_step": state["step"], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    model.train()
    ema = state["history"][-1][2] if state["history"] else None
    last_eval = last_ckpt = last_log = time.time()
    step_times: list[float] = []
    first_step_logged = False
    stop_reason = "total steps reached"
    while True:
        step = state["step"]
        total = plan["total_steps"]
        if total is not None and step >= total:
            break
        if args.max_steps is not None and step >= args.max_steps:
            stop_reason = "--max-steps"
            break
        elapsed = time.time() - t_start
        est = float(np.median(step_times[-5:])) if step_times else 0.0
        if budget_s is not None and elapsed + est + d["reserve_s"] > budget_s:
            stop_reason = "--minutes budget"
            break
        if total is None and budget_s is None and step >= plan["warmup"]:
            raise SystemExit("--total-steps auto needs --minutes (the total is set during warmup)")
        lr = cosine_lr(step, total or 10**9, plan["lr"], plan["warmup"], plan["min_lr_frac"])
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        batch = draw_batch(tokens, plan["seed"], step, n_win, seq)
        loss_sum = torch.zeros((), device=device)
        for i in range(0, n_win, micro):
            mb = batch[i:i + micro].to(device, non_blocking=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                h = fwd(mb[:, :-1])
                logits = model.lm_head(h)
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten(), reduction="sum") / step_tokens
            loss.backward()
            loss_sum += loss.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(params, plan["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss_sum)  # synchronizes
        dt = time.time() - t0
        step_times.append(dt)
        state["step"] = step + 1
        state["train_s"] += dt
        state["tokens_seen"] += step_tokens
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if not first_step_logged:
            log(f"first step done {time.time() - t_start:.1f}s after start (loss {value:.3f}, {dt:.2f}s)")
            first_step_logged = True
        # --total-steps auto: fixed once, inside warmup of the first invocation, from measured times
        need = 8 if state["step"] < plan["warmup"] else 2  # past warmup without a total: fix it now
        if plan["total_steps"] is None and len(step_times) >= need and budget_s is not None:
            sps = float(np.median(step_times[3:] if len(step_times) >= 8 else step_times[1:]))
            left = budget_s - (time.time() - t_start) - d["reserve_s"]
            n_evals = left / d["eval_every_s"]
            left -= n_evals * (3.0 if cuda else 30.0) + (left / d["ckpt_every_s"]) * (5.0 if cuda else 3.0)
            plan["total_steps"] = max(plan["warmup"] + 1, state["step"] + int(left / sps))
            log(f"schedule: total steps fixed at {plan['total_steps']} ({sps:.3f} s/step measured, "
                f"{plan['total_steps'] * step_tokens:,} tokens planned)")
        now = time.time()
        if now - last_log >= (20 if cuda else 10) or state["step"] == plan["total_steps"] or state["step"] <= 3:
            state["history"].append((state["step"], round(value, 4), round(ema, 4)))
            mem = f" mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
            log(f"step {state['step']}/{plan['total_steps']} loss {value:.4f} ema {ema:.4f} lr {lr:.2e} "
                f"gnorm {float(gnorm):.2f} {dt:.3f} s/step {step_tokens / dt:,.0f} tok/s{mem}")
            last_log = now
        if now - last_eval >= d["eval_every_s"]:
            evaluate("periodic")
            last_eval = time.time()
        if now - last_ckpt >= d["ckpt_every_s"]:
            checkpoint()
            last_ckpt = time.time()
    log(f"stopping at step {state['step']}: {stop_reason}")
    session.update({"end_step": state["step"], "stop": stop_reason,
                    "median_s_per_step": round(float(np.median(step_times)), 4) if step_times else None,
                    "tokens_per_s": round(step_tokens / float(np.median(step_times))) if step_times else None})
    state["sessions"].append(session)
    checkpoint()
    final = evaluate("final", final=True)
    checkpoint()  # with the final evaluation in the history
    metrics = {
        "shape": shape.as_dict(), "size": sizes, "plan": plan,
        "step": state["step"], "total_steps": plan["total_steps"], "tokens_seen": state["tokens_seen"],
        "epochs": round(state["tokens_seen"] / plan["train_tokens_file"], 3), "train_s": round(state["train_s"], 1),
        "heldout_final": final,
        "heldout_scope": "all held-out files" if not d["eval_tokens"] else f"the first {final['files']} held-out files",
        "heldout_history": state["heldout_history"], "loss_history": state["history"], "sessions": state["sessions"],
        "finished": state["step"] >= (plan["total_steps"] or 0),
    }
    write_json(work / "metrics.json", metrics)
    # Every part into <workdir>/export/part<N>/ (a later command on the same machine only copies
    # one directory to $OUT); part N of them, the metrics and the log into --export-dir.
    from .shards import export_from_workdir, parse_part

    n, m = parse_part(args.export_part)
    shutil.rmtree(work / "export", ignore_errors=True)
    export_from_workdir(work, work / "export", f"all/{m}")
    if args.export_dir is not None:
        args.export_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted((work / "export" / f"part{n}").iterdir()):
            shutil.copyfile(f, args.export_dir / f.name)
        shutil.copyfile(work / "metrics.json", args.export_dir / "metrics.json")
        shutil.copyfile(work / "log.txt", args.export_dir / "log.txt")
        log(f"part {n}/{m} of the shards, metrics.json and log.txt copied to {args.export_dir}")
    log(f"done in {time.time() - t_start:.0f}s wall; step {state['step']}/{plan['total_steps']}")
    if args.export_dir is not None:
        shutil.copyfile(work / "log.txt", args.export_dir / "log.txt")
    return metrics
