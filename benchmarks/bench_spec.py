"""Speculative decoding on the bundled demo model: plain decoding vs prompt lookup vs MTP
(N = 1..4) vs DSpark (block 4 and 8, confidence cut 0 and 0.5), at greedy and at T = 1.

    python benchmarks/bench_spec.py                    # 20 held-out prompts x 256 tokens
    python benchmarks/bench_spec.py --quick            # 4 prompts x 64 tokens (smoke)
    python benchmarks/bench_spec.py --methods plain,dspark-b8-c0 --temps 0

For each setting, over the same prompts with fixed seeds: decode tokens/s, the speedup over
plain decoding measured in the same run, tau (committed tokens per target forward), alpha
(accepted / verified drafts), the mean verify cost r = time(verify forward) / time(one-token
forward) and draft cost c (same unit), the predicted speedup tau / (r + c), and the share of
generated 8-grams already present earlier in the context: a tiny model's greedy output loops,
which flatters every drafter (prompt lookup most). Also the verify-cost curve r(k), k = 1..16.
Greedy runs also check that every method produced exactly plain decoding's tokens.

T = 1 is pure temperature sampling (no top-k / top-p / min-p), the distribution the demo's
drafts were trained against. The demo's files are prepared in the ds4tools cache on first use.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


FLOORS = {  # issue #7: on the demo; (greedy, T=1) speedup floors where the issue sets one
    "dspark": (2.0, 1.5),
    "mtp": (None, 1.3),
}


def methods_table():
    from ds4tools.engine.speculative.config import SpecConfig
    table = {"plain": None, "lookup": SpecConfig(lookup=8)}
    for n in (1, 2, 3, 4):
        table[f"mtp-n{n}"] = SpecConfig(mtp_file="@mtp", mtp_draft=n)
    for b in (4, 8):
        for c in (0.0, 0.5):
            table[f"dspark-b{b}-c{c:g}"] = SpecConfig(dspark=True, mtp_file="@dspark", dspark_block_size=b,
                                                      dspark_confidence=c)
    return table


def ngram_repetition(prompt: list[int], generated: list[int], n: int = 8) -> tuple[int, int]:
    """(generated n-grams already seen earlier in the context, generated n-grams)."""
    seq = list(prompt) + list(generated)
    seen, hits, total = set(), 0, 0
    start = len(prompt)
    for end in range(n, len(seq) + 1):
        gram = tuple(seq[end - n:end])
        if end - 1 >= start:
            total += 1
            hits += gram in seen
        seen.add(gram)
    return hits, total


def verify_cost_curve(engine, prompt_ids, ks=range(1, 17), repeat=7) -> dict:
    """r(k) = best time of a k-token forward over the best time of a one-token forward."""
    from ds4tools.bench.measure import cost_ratios, verify_seconds
    engine.forward(prompt_ids, 0, logits="last")
    ks = list(ks)
    return cost_ratios(verify_seconds(engine, len(prompt_ids), ks, repeat, [prompt_ids[-1]] * max(ks)))


def run_setting(engine, prompts, n_tokens, temperature, seed):
    from ds4tools.engine.sampling import Sampler
    from ds4tools.engine.speculative.stats import SpecStats
    sampler = Sampler(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    total = SpecStats(method=engine.drafter.name if engine.drafter else "plain")
    dec_tokens = dec_seconds = 0.0
    rep_hits = rep_total = 0
    outputs = []
    for i, p in enumerate(prompts):
        ids = [t.id for t in engine.generate(p, n_tokens, sampler=sampler, seed=seed + i,
                                             stop_at_eog=False)]
        outputs.append(ids)
        st = engine.last_stats
        dec_tokens += st.decode_tokens
        dec_seconds += st.decode_seconds
        h, t = ngram_repetition(engine.tokenize(p), ids)
        rep_hits, rep_total = rep_hits + h, rep_total + t
        if engine.last_spec_stats is not None:
            total.merge(engine.last_spec_stats)
    return {
        "tps": dec_tokens / dec_seconds if dec_seconds else 0.0,
        "spec": total if engine.drafter is not None else None,
        "repetition": rep_hits / rep_total if rep_total else 0.0,
        "outputs": outputs,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temps", default="0,1", help="comma-separated temperatures")
    ap.add_argument("--methods", default="all", help="comma-separated names (see the table) or all")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = min(args.prompts, 4), min(args.tokens, 64)

    import ds4tools
    from ds4tools.engine import Engine
    from ds4tools.demo import demo_model_path, demo_source, demo_support_path

    log = lambda msg: print(msg, flush=True)  # noqa: E731
    prompts_file = demo_source().parent / "prompts.json"
    if not prompts_file.is_file():
        prompts_file = Path(ds4tools.__file__).parent / "data" / "demo" / "prompts.json"
    prompts = [p["text"] for p in json.loads(prompts_file.read_text())][: args.prompts]
    files = {"@mtp": str(demo_support_path("mtp", progress=False)),
             "@dspark": str(demo_support_path("dspark", progress=False))}
    model = str(demo_model_path(progress=False))
    table = methods_table()
    names = list(table) if args.methods == "all" else args.methods.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown methods {unknown} (known: {', '.join(table)})")
    if "plain" not in names:
        names.insert(0, "plain")
    temps = [float(t) for t in args.temps.split(",")]

    engine = Engine(model, threads=args.threads)
    load = os.getloadavg()[0]
    one = " (short batches on one: the CPUs were busy)" if engine.model.single_thread else ""
    log(f"demo model {model}; {len(prompts)} prompts x {args.tokens} tokens; threads "
        f"{engine.threads}{one}; load average {load:.2f}")
    ids = engine.tokenize(prompts[0])
    curve = verify_cost_curve(engine, ids)
    log("r(k) = time(k-token forward) / time(1-token forward): "
        + " ".join(f"{k}:{v:.2f}" for k, v in curve.items()))

    results = {}
    for temp in temps:
        log(f"\n== temperature {temp:g} ==")
        log(f"{'method':<16}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'alpha':>7}{'r':>6}{'c':>6}"
            f"{'pred':>7}{'8-gram rep':>12}  accept per position")
        plain = None
        for name in names:
            cfg = table[name]
            if cfg is None:
                engine.spec, engine.drafter = None, None
            else:
                cfg = type(cfg)(**{k: files.get(v, v) if isinstance(v, str) else v
                                   for k, v in cfg.__dict__.items()})
                engine.set_spec(cfg)
            run_setting(engine, prompts[:1], 16, temp, args.seed)  # warm-up (numba, caches)
            res = run_setting(engine, prompts, args.tokens, temp, args.seed)
            results[(temp, name)] = res
            if name == "plain":
                plain = res
            speedup = res["tps"] / plain["tps"] if plain and plain["tps"] else 0.0
            sp = res["spec"]
            same = ""
            if temp == 0 and plain is not None and name != "plain":
                same = "" if res["outputs"] == plain["outputs"] else "  MISMATCH vs plain!"
            if sp is None:
                log(f"{name:<16}{res['tps']:>9.1f}{1.0:>9.2f}{'':>7}{'':>7}{'':>6}{'':>6}{'':>7}"
                    f"{res['repetition']:>12.2f}")
            else:
                per = " ".join(f"{a:.2f}" for a in sp.accept_per_position)
                log(f"{name:<16}{res['tps']:>9.1f}{speedup:>9.2f}{sp.tau:>7.2f}{sp.alpha:>7.2f}"
                    f"{sp.verify_cost_ratio():>6.2f}{sp.draft_cost_ratio():>6.2f}"
                    f"{sp.predicted_speedup:>7.2f}{res['repetition']:>12.2f}  {per}{same}")
            res["speedup"] = speedup

    log("\nfloors (issue #7, demo): " + "; ".join(
        f"{fam} {'greedy' if i == 0 else 'T=1'} >= {floor}x: best "
        + f"{max([r['speedup'] for (t, n), r in results.items() if n.startswith(fam) and t == (0.0 if i == 0 else 1.0)] or [0]):.2f}x"
        for fam, floors in FLOORS.items() for i, floor in enumerate(floors) if floor is not None))
    if args.json:
        doc = {"r_k": curve, "settings": [
            {"temperature": t, "method": n, "tokens_per_second": r["tps"], "speedup": r["speedup"],
             "ngram8_repetition": r["repetition"],
             "spec": r["spec"].as_dict() if r["spec"] is not None else None}
            for (t, n), r in results.items()]}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
