"""One distill run, end to end: check everything, prepare the data (corpus, self-generated
continuations, the target's features), train, write the draft, measure it with the engine,
write the figures into the draft's metadata and a JSON report beside it.

The run directory (``--resume DIR``, else a temporary folder beside the output, removed at the
end) holds every finished stage: ``run.json`` (what the run is; a resumed run must match it),
``state.json`` (how far the data stages got and the seconds spent), ``corpus.npz``,
``windows/`` (the windows' tokens and features, .npy memory maps) and ``checkpoint.pt``. A
killed run given the same ``--resume DIR`` continues where it stopped.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import UsageError, about
from .options import DistillOptions, format_duration

__all__ = ["run_distill", "DistillResult", "report_path_for"]

RUN_FORMAT = 1
#: text windows when --windows is not given ...
DEFAULT_WINDOWS = 1024
#: ... but with --time, at most as many as fit this share of the budget (and at least this many)
FEATURE_SHARE = 0.25
MIN_FITTED_WINDOWS = 64


@dataclass
class DistillResult:
    output: str
    report_path: str
    report: dict

    @property
    def summary(self) -> str:
        r = self.report
        ev = r.get("evaluation", {})
        h = ev.get("heldout", {})
        if r["kind"] == "dspark" and h.get("dspark", {}).get("tau") is not None:
            fig = (f"held-out tau {h['dspark']['tau']:.3f} at block {h['block']} "
                   f"(prompt lookup {h['prompt_lookup']['tau']:.3f}, {h['dspark']['n']} anchors)")
        elif r["kind"] == "mtp" and "mtp_two_ahead_agreement" in h:
            fig = (f"held-out two-ahead agreement {h['mtp_two_ahead_agreement']:.4f} (prompt lookup "
                   f"{h['prompt_lookup_first_draft_agreement']:.4f}, {h['rows']} rows)")
        else:
            fig = "no held-out figures"
        t = r["training"]
        return (f"{self.output}: {r['kind']} draft, {t['steps']} steps in "
                f"{format_duration(t['train_seconds'])}; {fig}; report {self.report_path}")


def report_path_for(out: str) -> str:
    base = out[:-5] if out.endswith(".gguf") else out
    return base + ".distill.json"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _check_outputs(out: str, report: str, opts: DistillOptions, inputs) -> None:
    for path in (out, report):
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(about(path, "its folder does not exist"))
        if os.path.isdir(path):
            raise UsageError(about(path, "is a directory"))
        for src in inputs:
            if src and os.path.exists(path) and _same(src, path):
                raise UsageError(about(path, "refusing to write over an input file"))
        if os.path.exists(path) and not opts.overwrite:
            raise UsageError(about(path, "already exists (pass --overwrite to replace it)"))


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def _read_json(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


class RunDir:
    def __init__(self, path: str, temporary: bool):
        self.path = path
        self.temporary = temporary
        self.state_path = os.path.join(path, "state.json")
        self.state = _read_json(self.state_path) if os.path.exists(self.state_path) else {}

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def save(self) -> None:
        _write_json(self.state_path, self.state)


def _open_run_dir(opts: DistillOptions, out: str, identity: dict) -> RunDir:
    """The run directory: --resume DIR (continued when it holds this run, created otherwise),
    or a fresh temporary one beside the output."""
    if opts.resume is None:
        folder = os.path.dirname(os.path.abspath(out))
        return RunDir(tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.distill-", dir=folder), True)
    path = os.path.abspath(opts.resume)
    meta = os.path.join(path, "run.json")
    if os.path.isfile(path):
        raise UsageError(about(opts.resume, "--resume: is a file, not a run directory"))
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(meta):
        raise UsageError(about(opts.resume, "--resume: the folder is not empty and holds no distill "
                                            "run (no run.json); give a new or empty folder"))
    if os.path.exists(meta):
        try:
            old = _read_json(meta)
        except (OSError, ValueError) as e:
            raise UsageError(about(meta, f"--resume: cannot read the run's description ({e})")) from None
        if old.get("format") != RUN_FORMAT:
            raise UsageError(about(meta, "--resume: a run of another ds4tools version"))
        diff = [k for k in sorted(set(old["identity"]) | set(identity))
                if old["identity"].get(k) != identity.get(k)]
        if diff:
            k = diff[0]
            raise UsageError(about(opts.resume, f"--resume: this run was started with {k} = "
                                                f"{old['identity'].get(k)!r}, now {identity.get(k)!r}; "
                                                f"resume it with the same options or use a new folder"))
        return RunDir(path, False)
    os.makedirs(path, exist_ok=True)
    _write_json(meta, {"format": RUN_FORMAT, "identity": identity})
    return RunDir(path, False)


def _bar(total, desc, opts, unit="window", initial=0):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=None if opts.progress is None else not opts.progress, dynamic_ncols=True)


def run_distill(target_path, out, opts: DistillOptions, report=_stderr, on_step=None) -> DistillResult:
    """Distill a ``opts.kind`` draft for ``target_path`` into ``out`` (see the module doc)."""
    opts.check()
    from . import require_torch
    from .data import collect_files, load_corpus, read_eval_prompts
    from .target import check_target_layers, default_target_layers, mask_token, open_frozen_target
    t_start = time.monotonic()
    out = os.fspath(out)
    target_path = os.fspath(target_path)
    rep_path = report_path_for(out)
    # --- everything that can be refused is refused before anything is written ---------------
    target = open_frozen_target(target_path, threads=opts.threads)
    try:
        hp = target.hp
        inputs = [target_path, *opts.data, opts.eval_prompts]
        _check_outputs(out, rep_path, opts, inputs)
        block = opts.default("block_size") if opts.kind == "dspark" else 1
        n_ctx = target.engine.n_ctx
        seq_len = min(opts.seq_len or 512, n_ctx - block - 2)
        if seq_len < 16:
            raise UsageError(about(target_path, f"a context of {n_ctx} leaves no room for training "
                                                f"windows of 16 tokens"))
        layers = None
        if opts.kind == "dspark":
            layers = list(opts.target_layers) if opts.target_layers is not None else \
                default_target_layers(hp.n_layer)
            check_target_layers(layers, hp, target_path)
        files = collect_files(opts.data, opts.include, opts.exclude)
        prompts = read_eval_prompts(opts.eval_prompts, target.tokenizer) if opts.eval_prompts else None
        mask_id = mask_token(target.engine.gguf.metadata, target.tokenizer)
        torch = require_torch()
        if opts.threads is not None:
            torch.set_num_threads(opts.threads)
        identity = {
            **opts.signature(), "target": os.path.abspath(target_path),
            "target_bytes": os.path.getsize(target_path),
            "data": [os.path.abspath(p) for p in opts.data], "seq_len": seq_len,
            "target_layers": layers, "block_size": block if opts.kind == "dspark" else None,
            "mask_token": mask_id if opts.kind == "dspark" else None,
        }
        corpus = None
        if opts.resume is None or not os.path.exists(os.path.join(opts.resume, "corpus.npz")):
            corpus = load_corpus(files, target.tokenizer, opts.data)  # may refuse the data
        run = _open_run_dir(opts, out, identity)
        try:
            return _run(target, out, rep_path, opts, run, corpus, files, prompts, seq_len, block,
                        layers, mask_id, t_start, report, on_step)
        finally:
            if run.temporary:
                shutil.rmtree(run.path, ignore_errors=True)
    finally:
        target.close()


def _run(target, out, rep_path, opts, run, corpus, files, prompts, seq_len, block, layers,
         mask_id, t_start, report, on_step) -> DistillResult:
    import torch

    from .data import Corpus, generate_windows, window_starts
    from .features import FeatureStore, choose_dtype
    st = run.state
    clock = time.monotonic
    session = clock()
    # a fresh run's clock started with the command (tokenizing the corpus counts); a resumed
    # one continues from what the run directory recorded
    base_elapsed = st["elapsed"] if "elapsed" in st else session - t_start

    def elapsed() -> float:
        return base_elapsed + (clock() - session)

    # --- corpus ---------------------------------------------------------------------------------
    cpath = run.file("corpus.npz")
    if os.path.exists(cpath):
        z = np.load(cpath)
        info = json.loads(str(z["info"]))
        corpus = Corpus(z["train"], z["heldout"], **info)
    else:
        info = {"files": corpus.files, "heldout_files": corpus.heldout_files, "bytes": corpus.bytes,
                "split": corpus.split}
        tmp = run.file("corpus.tmp.npz")
        np.savez(tmp, train=corpus.train, heldout=corpus.heldout, info=json.dumps(info))
        os.replace(tmp, cpath)
    report(f"ds4tools: distill {opts.kind}: {corpus.files} files, {len(corpus.train):,} train tokens, "
           f"{len(corpus.heldout):,} held-out tokens (held out: {corpus.split}); run directory "
           f"{run.path}" + ("" if run.temporary else " (resumable)"))

    # --- windows: text, then self-generated ----------------------------------------------------
    if len(corpus.train) < seq_len:
        seq_len_eff = len(corpus.train)
    else:
        seq_len_eff = seq_len
    n_gen = opts.self_generate
    wdir = run.file("windows")
    os.makedirs(wdir, exist_ok=True)
    n_feat = len(layers) if layers else 0
    H = target.hp.n_embd
    rollouts = opts.rollouts if layers else 0
    if "dtype" not in st:
        n_text = opts.windows if opts.windows is not None else DEFAULT_WINDOWS
        starts = window_starts(len(corpus.train), seq_len_eff, max(1, n_text), opts.seed)
        sample = corpus.train[starts[0]:starts[0] + seq_len_eff]
        st["dtype"] = choose_dtype(target, sample, layers or [])  # also compiles the kernels
        if opts.windows is None and opts.time_s is not None:
            per = _window_seconds(target, sample, layers or [], rollouts, block, opts.seed)
            fit = max(MIN_FITTED_WINDOWS, int(FEATURE_SHARE * opts.time_s / per))
            if fit < n_text:
                n_text = fit
                report(f"ds4tools: distill {opts.kind}: {n_text} text windows (a window's features "
                       f"take {per:.2f} s; the default {DEFAULT_WINDOWS} would not leave "
                       f"{1 - FEATURE_SHARE:.0%} of --time {format_duration(opts.time_s)} to train; "
                       f"--windows sets the count)")
        n = n_text + n_gen
        need = _store_bytes(n, seq_len_eff, n_feat, H, rollouts, n_text, block)
        free = shutil.disk_usage(run.path).free
        if need > 0.9 * free:
            raise UsageError(about(run.path, f"the target's features need {need / 2**30:.1f} GiB "
                                             f"(float16), {free / 2**30:.1f} GiB are free there: "
                                             f"fewer --windows, a shorter --seq-len, or --resume "
                                             f"DIR on a larger disk"))
        store = FeatureStore(wdir, n, seq_len_eff, n_feat * H, H, st["dtype"], create=True,
                             rollouts=rollouts, n_rollout_windows=n_text, block=block)
        for i, s in enumerate(starts[:n_text]):
            store.tokens[i] = corpus.train[s:s + seq_len_eff]
        store.flush()
        st.update(generated=0, features=0, seq_len=seq_len_eff, text_windows=n_text, elapsed=elapsed())
        run.save()
    else:
        n_text = st["text_windows"]
        n = n_text + n_gen
        store = FeatureStore(wdir, n, st["seq_len"], n_feat * H, H, st["dtype"], create=False,
                             rollouts=rollouts, n_rollout_windows=n_text, block=block)
    seq_len_eff = st["seq_len"]

    last = [clock()]

    def checkpoint_data(key, i):
        st[key] = i + 1
        if clock() - last[0] > 5.0 or i + 1 in (n_gen, n):
            store.flush()
            st["elapsed"] = elapsed()
            run.save()
            last[0] = clock()

    if st["generated"] < n_gen:
        t0 = clock()
        with _bar(n_gen, "self-generate", opts, initial=st["generated"]) as bar:
            def on_gen(i):
                checkpoint_data("generated", i)
                bar.update(1)
            generate_windows(target, corpus.train, seq_len_eff, n_gen, opts.seed,
                             store.tokens[n_text:], st["generated"], on_gen)
        st["generate_seconds"] = st.get("generate_seconds", 0.0) + clock() - t0
    if st["features"] < n:
        t0 = clock()
        with _bar(n, "target features", opts, initial=st["features"]) as bar:
            for i in range(st["features"], n):
                store.fill(target, i, layers or [], opts.seed)
                checkpoint_data("features", i)
                bar.update(1)
        st["features_seconds"] = st.get("features_seconds", 0.0) + clock() - t0
    store.flush()
    st["elapsed"] = elapsed()
    run.save()
    data_info = {
        "files": corpus.files, "heldout_files": corpus.heldout_files, "bytes_read": corpus.bytes,
        "heldout_split": corpus.split, "train_tokens": int(len(corpus.train)),
        "heldout_tokens": int(len(corpus.heldout)), "seq_len": seq_len_eff, "text_windows": n_text,
        "self_generated_windows": n_gen, "self_generated": "even rows greedy, odd rows T = 1",
        "rollouts_per_text_window": opts.rollouts if opts.kind == "dspark" else 0,
        "feature_dtype": st["dtype"], "generate_seconds": round(st.get("generate_seconds", 0.0), 1),
        "features_seconds": round(st.get("features_seconds", 0.0), 1),
    }

    # --- train -----------------------------------------------------------------------------------
    from .train import train_loop
    torch.manual_seed(opts.seed)
    module, task = _build(target, opts, store, layers, block, mask_id)
    from .train import CHECKPOINT
    if not os.path.exists(run.file(CHECKPOINT)):
        _init(module, target, opts)
    n_params = sum(p.numel() for p in module.parameters())
    report(f"ds4tools: distill {opts.kind}: {n_params:,} trainable parameters, {n} windows of "
           f"{seq_len_eff} tokens ({n_text} text, {n_gen} self-generated)"
           + (f", target layers {','.join(map(str, layers))}, block {block}" if layers else ""))
    lr = opts.default("lr")
    result = train_loop(module, task, seed=opts.seed, steps=opts.steps, time_s=opts.time_s, lr=lr,
                        warmup=opts.default("warmup"), run_dir=run.path, elapsed=st["elapsed"],
                        checkpoint_seconds=opts.checkpoint_seconds, progress=opts.progress,
                        desc=f"distill {opts.kind}", on_step=on_step, bf16=opts.precision == "bf16")
    st["elapsed"] = result.elapsed_seconds
    run.save()
    report(f"ds4tools: distill {opts.kind}: {result.steps} steps, {format_duration(result.train_seconds)} "
           f"of training" + (f" (resumed at step {result.resumed_from})" if result.resumed_from else ""))

    # --- write, measure, write again with the figures -----------------------------------------------
    from .export import write_draft
    module.eval()
    cfg = _draft_config(target, opts, layers, block, mask_id)
    eval_path = run.file("draft-eval.gguf")
    write_draft(opts.kind, module, target, eval_path, cfg, opts.type, overwrite=True, progress=False)
    t0 = clock()
    evaluation = _evaluate(target, eval_path, opts, corpus, prompts, seq_len_eff, block)
    eval_seconds = clock() - t0
    evaluation["seconds"] = round(eval_seconds, 1)
    doc = {
        "kind": opts.kind, "target": os.path.abspath(target.path), "output": os.path.abspath(out),
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress",)},
        "draft": {**cfg, "parameters": int(n_params)},
        "data": data_info,
        "training": {"steps": result.steps, "total_steps": result.total_steps,
                     "train_seconds": round(result.train_seconds, 1),
                     "run_seconds_before_evaluation": round(result.elapsed_seconds, 1),
                     "stopped_by": result.stopped_by, "resumed_from_step": result.resumed_from,
                     "lr": lr, "final_ema": result.ema, "history": result.history},
        "evaluation": evaluation,
    }
    result_doc = DistillResult(os.path.abspath(out), os.path.abspath(rep_path), doc)
    write_draft(opts.kind, module, target, out, cfg, opts.type, overwrite=opts.overwrite,
                progress=opts.progress, extra=_figure_keys(doc))
    _write_json(rep_path, doc)
    return result_doc


def _window_seconds(target, sample, layers, rollouts: int, block: int, seed: int) -> float:
    """Seconds the features (and rollouts) of one window take, timed on ``sample``."""
    from .features import rollout_anchors, target_features, target_rollouts
    t0 = time.monotonic()
    got = target_features(target, sample, layers, logits=bool(rollouts))
    per = time.monotonic() - t0
    if rollouts:
        k = min(4, rollouts)
        anchors = rollout_anchors(len(sample), k, seed, 0)
        t0 = time.monotonic()
        target_rollouts(target, got[1], got[2], anchors, block)
        per += (time.monotonic() - t0) * rollouts / max(1, len(anchors))
    return max(per, 1e-4)


def _store_bytes(n, seq_len, n_feat, n_embd, rollouts, n_text, block) -> int:
    """Disk bytes of the window store (float16)."""
    per_token = (n_feat + 1) * n_embd * 2 + 4
    return n * seq_len * per_token + n_text * rollouts * block * (n_embd * 2 + 4)


def _shape(target, qk_norm: bool):
    from .model import Shape
    hp = target.hp
    return Shape(hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.rms_eps, hp.n_vocab,
                 qk_norm)


def _rope(target, kind: str):
    """The rope tables the engine's drafter uses: the target's for an MTP head; for a DSpark
    draft its own, over the whole head dim and without frequency factors
    (speculative/load.py's _draft_hparams, speculative/dspark.py)."""
    from ..engine import kernels
    from .model import Rope
    hp = target.hp
    neox = hp.rope_type == "neox"
    if kind == "mtp":
        cos, sin = target.rope_tables()
    else:
        cos, sin = kernels.rope_tables(target.engine.n_ctx, hp.head_dim, hp.rope_freq_base,
                                       freq_scale=hp.rope_freq_scale, yarn=hp.yarn)
    return Rope(cos, sin, neox)


class _DSparkTask:
    ema_keys = ("accept", "top1", "l1")

    def __init__(self, store, embed, lm_head, rope, mask_id, block, batch, anchors, rollouts):
        self.store, self.embed, self.lm_head, self.rope = store, embed, lm_head, rope
        self.mask_id, self.block, self.n_batch, self.anchors = mask_id, block, batch, anchors
        self.rollouts = rollouts

    def batch(self, rng):
        from .dspark import sample_batch
        n = self.store.tokens.shape[0]
        windows = rng.choice(n, size=min(self.n_batch, n), replace=False)
        return sample_batch(self.store, windows, rng, self.anchors, self.block, self.rollouts)

    def loss(self, module, batch):
        from .dspark import loss_and_stats
        return loss_and_stats(module, self.embed, self.lm_head, self.rope, self.mask_id, self.block, batch)

    def postfix(self, ema):
        from .dspark import tau_estimate
        return {"loss": f"{float(ema['loss']):.3f}", "tau~": f"{tau_estimate(ema['accept']):.2f}",
                "top1@1": f"{float(np.asarray(ema['top1'])[0]):.2f}"}


class _MtpTask:
    ema_keys = ("agree", "kl")

    def __init__(self, store, embed, lm_head, rope, batch):
        self.store, self.embed, self.lm_head, self.rope, self.n_batch = store, embed, lm_head, rope, batch

    def batch(self, rng):
        from .mtp import sample_batch
        n = self.store.tokens.shape[0]
        return sample_batch(self.store, rng.choice(n, size=min(self.n_batch, n), replace=False))

    def loss(self, module, batch):
        from .mtp import loss_and_stats
        return loss_and_stats(module, self.embed, self.lm_head, self.rope, batch)

    def postfix(self, ema):
        return {"loss": f"{float(ema['loss']):.3f}", "agree~": f"{float(ema['agree']):.3f}"}


def _build(target, opts, store, layers, block, mask_id):
    import torch
    embed = torch.from_numpy(target.embedding())
    lm_head = torch.from_numpy(target.lm_head())
    if opts.kind == "dspark":
        from .dspark import build
        module = build(_shape(target, True), len(layers), opts.default("layers"), opts.markov_rank)
        task = _DSparkTask(store, embed, lm_head, _rope(target, "dspark"), mask_id, block,
                           opts.default("batch"), opts.anchors, opts.rollouts)
    else:
        from .mtp import build
        qk = target.engine.weights.layers[-1].q_norm is not None
        module = build(_shape(target, qk))
        task = _MtpTask(store, embed, lm_head, _rope(target, "mtp"), opts.default("batch"))
    return module, task


def _init(module, target, opts):
    if opts.kind == "dspark":
        from .dspark import init_from_target
    else:
        from .mtp import init_from_target
    init_from_target(module, target, opts.seed)


def _draft_config(target, opts, layers, block, mask_id) -> dict:
    if opts.kind == "dspark":
        return {"layout": "llama.cpp dflash (DSpark)", "layers": opts.default("layers"),
                "block_size": block, "target_layers": layers,
                "dflash_target_layers": [x + 1 for x in layers], "markov_rank": opts.markov_rank,
                "mask_token_id": mask_id}
    return {"layout": "ds4 MTP support (dense NextN layer)", "layers": 1,
            "nextn_layer_index": target.hp.n_layer}


def _evaluate(target, path, opts, corpus, prompts, seq_len, block) -> dict:
    from .data import prompt_length
    from .evaluate import heldout_dspark, heldout_mtp, heldout_segments, prompts_eval
    segments = heldout_segments(corpus.heldout, seq_len)
    out = {}
    if segments:
        if opts.kind == "dspark":
            out["heldout"] = heldout_dspark(target, path, segments, block, opts.eval_anchors, opts.progress)
        else:
            out["heldout"] = heldout_mtp(target, path, segments, opts.progress)
    if prompts is None:  # the first tokens of held-out segments (or of the train text)
        src = segments or heldout_segments(corpus.train, seq_len)
        prompts = [s[:prompt_length(seq_len)].tolist() for s in src[:20]]
        where = "held-out text" if segments else "train text (no held-out segment)"
    else:
        where = opts.eval_prompts
    if opts.eval_tokens and prompts:
        out["prompts"] = {"source": where,
                          **prompts_eval(target, path, opts.kind, prompts, opts.eval_tokens, block,
                                         opts.seed, opts.progress)}
    return out


def _figure_keys(doc: dict):
    """The measured figures as GGUF keys (distill.*)."""
    from gguf import GGUFValueType as V

    from ..gguf_io import MetaKey
    keys = [MetaKey("distill.kind", doc["kind"], V.STRING),
            MetaKey("distill.target", os.path.basename(doc["target"]), V.STRING),
            MetaKey("distill.steps", int(doc["training"]["steps"]), V.UINT32),
            MetaKey("distill.train_seconds", float(doc["training"]["train_seconds"]), V.FLOAT32),
            MetaKey("distill.seed", int(doc["options"]["seed"]), V.UINT32)]
    ev = doc["evaluation"]
    h = ev.get("heldout", {})
    if doc["kind"] == "dspark" and h.get("dspark", {}).get("tau") is not None:
        keys += [MetaKey("distill.heldout.block_size", int(h["block"]), V.UINT32),
                 MetaKey("distill.heldout.anchors", int(h["dspark"]["n"]), V.UINT32),
                 MetaKey("distill.heldout.tau", float(h["dspark"]["tau"]), V.FLOAT32),
                 MetaKey("distill.heldout.tau_conf_cut_0.5", float(h["dspark_conf_cut_0.5"]["tau"]), V.FLOAT32),
                 MetaKey("distill.heldout.prompt_lookup_tau", float(h["prompt_lookup"]["tau"]), V.FLOAT32)]
    if doc["kind"] == "mtp" and "mtp_two_ahead_agreement" in h:
        keys += [MetaKey("distill.heldout.rows", int(h["rows"]), V.UINT32),
                 MetaKey("distill.heldout.two_ahead_agreement", float(h["mtp_two_ahead_agreement"]), V.FLOAT32),
                 MetaKey("distill.heldout.prompt_lookup_agreement",
                         float(h["prompt_lookup_first_draft_agreement"]), V.FLOAT32)]
    p = ev.get("prompts")
    if p:
        for mode in ("greedy", "t1"):
            keys += [MetaKey(f"distill.prompts.{mode}.tau", float(p[mode]["draft"]["tau"]), V.FLOAT32),
                     MetaKey(f"distill.prompts.{mode}.prompt_lookup_tau", float(p[mode]["lookup"]["tau"]),
                             V.FLOAT32)]
    return keys
