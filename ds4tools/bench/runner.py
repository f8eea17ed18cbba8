"""What ``ds4tools bench`` does, in order, as one function that returns the result document
(schema ``ds4tools.bench/1``, docs/cli.md); ``report`` prints it.

1. load the model and build every drafter of the sweep (bad files fail before any timing);
2. measure the memory-copy bandwidth;
3. warm up: a prefill, a verify forward, and a short generation plainly and with each drafter
   (numba compiles or loads its cache here, never inside a timed run);
4. pp tests: the prompt's forward from an empty cache, for each -p size;
5. tg tests: greedy generation of n tokens after the prompt (depth P = the longest prompt),
   decode tokens/s of the steps after the first and the GB/s of weights that reads;
6. the verify-cost curve r(k) at depth P;
7. the sweep: for each n and temperature, plain decoding and every setting, interleaved round
   by round (best of --repeat each), same prompt, same seed, same number of tokens.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from .. import __version__
from ..errors import UsageError
from . import measure
from .options import DEFAULT_N_PROMPT, BenchOptions

SCHEMA = "ds4tools.bench/1"
#: memory-copy buffer: larger than any CPU cache, small enough for a shared machine
MEMCPY_BYTES = 1 << 28


def _progress(total: int, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc="bench", unit="test", file=sys.stderr, leave=False,
                disable=None if enabled is None else not enabled)


def _model_path(opts: BenchOptions):
    """-m, or the bundled demo model (ds4tools.demo, prepared on first use): with --glm-mtp its
    variant with the NextN layer embedded."""
    if opts.model is not None:
        return opts.model
    from ..demo import resolve_model
    glm = next((s.config for s in opts.settings if s.config.glm_mtp), None)
    return resolve_model(None, glm, progress=opts.progress is not False)[0]


def _spec(opts: BenchOptions, setting):
    """A setting's SpecConfig; on the demo model (no -m), --dspark without --mtp FILE drafts
    with the demo's DSpark draft."""
    if opts.model is not None:
        return setting.config
    from ..demo import with_demo_draft
    return with_demo_draft(setting.config, progress=opts.progress is not False)


def _load(opts: BenchOptions, model, n_ctx: int):
    from ..engine.api import Engine
    return Engine(model, n_ctx=n_ctx, threads=opts.threads, cache_type=opts.cache_type,
                  exact=opts.exact)


def _prompt_ids(engine, opts: BenchOptions, n_tokens: int | None) -> list[int]:
    """The text's tokens (tiled or cut to n_tokens when -p is given), or synthetic ids."""
    if opts.prompt is None:
        rng = np.random.default_rng(0)
        return [int(t) for t in rng.integers(0, min(engine.tokenizer.n_vocab, engine.hparams.n_vocab),
                                             max(1, n_tokens))]
    ids = engine.tokenize(opts.prompt)
    if not ids:
        raise UsageError("the prompt gives no tokens")
    if n_tokens:
        ids = (ids * (n_tokens // len(ids) + 1))[:n_tokens]
    return ids


def _ctx_needed(opts: BenchOptions, n_prompt: int) -> int:
    return n_prompt + max(opts.max_gen, max(opts.rk)) + 1


def _model_info(engine) -> dict:
    from gguf import LlamaFileType
    g = engine.gguf
    by_type: dict[str, list[int]] = {}
    params = size = 0
    for t in g.tensors.values():
        params += int(t.n_elements)
        size += int(t.n_bytes)
        if len(t.shape) >= 2:
            entry = by_type.setdefault(t.type_name, [0, 0])
            entry[0] += 1
            entry[1] += int(t.n_bytes)
    ftype = g.metadata.get("general.file_type")
    try:
        ftype = LlamaFileType(int(ftype)).name.replace("MOSTLY_", "").replace("ALL_", "") \
            if ftype is not None else None
    except (TypeError, ValueError):
        ftype = None
    name = g.metadata.get("general.name")
    hp = engine.hparams
    return {
        "path": engine.path, "name": name if isinstance(name, str) else None,
        "architecture": hp.arch, "file_type": ftype,
        "formats": [{"type": k, "tensors": v[0], "bytes": v[1]}
                    for k, v in sorted(by_type.items(), key=lambda kv: -kv[1][1])],
        "size_bytes": size, "params": params, "n_layer": hp.n_layer, "n_embd": hp.n_embd,
        "n_vocab": hp.n_vocab, "weight_bytes_per_token": measure.decode_weight_bytes(engine),
        "int8_matmuls": any(lin.int8 for lin in engine.weights.linears()),
    }


def _load_average() -> list | None:
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):  # not on every platform
        return None


def _sampler(temperature: float):
    from ..engine.sampling import Sampler
    return Sampler(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)


def _test_name(n: int, depth: int, temperature: float = 0.0) -> str:
    return f"tg{n} @ d{depth}" + (f" T={temperature:g}" if temperature > 0 else "")


def run_bench(opts: BenchOptions) -> dict:
    """Measure what ``opts`` asks for; returns the ``ds4tools.bench/1`` document."""
    sizes = opts.n_prompt
    if opts.prompt is None:
        sizes = sizes or [DEFAULT_N_PROMPT]
        guess = max(sizes)
    else:  # tokens are at most the UTF-8 bytes (+ BOS/EOS): a bound until the text is tokenized
        guess = max(sizes) if sizes else len(opts.prompt.encode("utf-8")) + 4
    model = _model_path(opts)
    engine = _load(opts, model, _ctx_needed(opts, max(1, guess)))
    ids = _prompt_ids(engine, opts, max(sizes) if sizes else None)
    if _ctx_needed(opts, len(ids)) > engine.n_ctx:
        engine.close()
        engine = _load(opts, model, _ctx_needed(opts, len(ids)))
    sizes = [p for p in (sizes or [len(ids)]) if p > 0]
    try:
        return _measure(engine, opts, ids, sizes)
    finally:
        engine.close()


def _measure(engine, opts: BenchOptions, ids: list[int], sizes: list[int]) -> dict:
    depth = len(ids)
    drafters = []
    for s in opts.settings:
        engine.set_spec(_spec(opts, s))
        drafters.append(engine.drafter)
    engine.spec = engine.drafter = None

    ns = [n for n in opts.n_gen if n > 0]
    blocks = [(n, 0.0) for n in ns] + [(n, t) for t in opts.temperatures if t > 0 for n in ns
                                       if opts.settings]
    swept = lambda temp: drafters if temp in opts.temperatures else []  # noqa: E731
    total = 3 + len(sizes) + (1 if opts.rk else 0) + opts.repeat * sum(1 + len(swept(t)) for _, t in blocks)
    doc = {"schema": SCHEMA, "version": __version__}
    with _progress(total, opts.progress) as bar:
        def step(what):
            bar.set_postfix_str(what, refresh=False)
            bar.update(1)

        bw = measure.memcpy_bandwidth(MEMCPY_BYTES, repeat=5)
        step("memcpy")
        _warm_up(engine, ids, opts, drafters)
        step("warm-up")
        info = _model_info(engine)
        info["demo"] = opts.model is None
        doc["model"] = info
        doc["system"] = {"threads": engine.threads, "single_thread_kernels": engine.model.single_thread,
                         "cpu_count": os.cpu_count(), "load_average": _load_average(),
                         "memcpy_gbps": bw, "memcpy_bytes": MEMCPY_BYTES}
        doc["settings"] = {"n_prompt": sizes, "n_gen": ns, "rk": list(opts.rk), "repeat": opts.repeat,
                           "prompt": "synthetic" if opts.prompt is None else "text",
                           "prompt_tokens": len(ids), "depth": depth, "ctx": engine.n_ctx,
                           "exact": opts.exact, "cache_type": opts.cache_type,
                           "temperatures": list(opts.temperatures), "seed": opts.seed}
        step("model")

        doc.update(pp=[], tg=[], rk=[], spec=[])
        for p in sizes:
            sec = measure.prefill_seconds(engine, ids[:p], opts.repeat)
            doc["pp"].append({"test": f"pp{p}", "n_tokens": p, "seconds": sec, "tps": p / sec})
            step(f"pp{p}")

        if opts.rk:
            engine.cache.clear()
            engine.forward(ids, 0, logits="none")
            times = measure.verify_seconds(engine, depth, opts.rk, opts.repeat, ids[-1:] * max(opts.rk))
            for k, r in measure.cost_ratios(times).items():
                doc["rk"].append({"test": f"verify{k} @ d{depth}", "k": k, "depth": depth,
                                  "seconds": times[k], "tps": k / times[k], "r": r})
            step("r(k)")

        measure.reset_expert_reads(engine)  # MoE: count the experts the decode steps use
        for n, temp in blocks:
            plain, rows = _sweep_block(engine, ids, n, temp, opts, swept(temp), step)
            name = _test_name(n, depth, temp)
            if temp == 0:
                info["weight_bytes_per_token"] = measure.decode_weight_bytes(engine)
                gbps = info["weight_bytes_per_token"] * plain["tps"] / 1e9
                doc["tg"].append({"test": name, "n_tokens": n, "depth": depth,
                                  "decode_tokens": plain["decode_tokens"], "seconds": plain["seconds"],
                                  "tps": plain["tps"], "weight_gbps": gbps, "memcpy_ratio": gbps / bw})
            for s, d, r in zip(opts.settings, drafters, rows):
                sp = r["spec"]
                doc["spec"].append({
                    "test": name, "n_tokens": n, "depth": depth, "temperature": temp,
                    "family": s.family, "setting": s.label, "params": s.params,
                    "drafter": d.describe(), "tps": r["tps"], "plain_tps": plain["tps"],
                    "speedup": r["tps"] / plain["tps"] if plain["tps"] else 0.0,
                    "tau": sp.tau, "alpha": sp.alpha,
                    "matches_plain": (r["tokens"] == plain["tokens"]) if temp == 0 else None,
                    "stats": sp.as_dict()})
    return doc


def _warm_up(engine, ids, opts: BenchOptions, drafters) -> None:
    engine.cache.clear()
    engine.forward(ids, 0, logits="last")
    k = max(opts.rk) if opts.rk else 1
    engine.forward(ids[-1:] * k, len(ids), logits="all")
    n = min(max(opts.max_gen, 2), 8)
    for temp in sorted({0.0, *opts.temperatures}):
        for d in [None] + drafters:
            measure.generation(engine, ids, n, _sampler(temp), opts.seed, d, strict=_strict(d, opts))


def _strict(drafter, opts: BenchOptions) -> bool:
    return drafter is not None and drafter.name == "dspark" and opts.drafters.dspark_strict


def _sweep_block(engine, ids, n, temp, opts: BenchOptions, drafters, step):
    """Plain decoding and each drafter at (n, temp), interleaved round by round; the best
    round of each (highest decode t/s). Returns (plain, [per drafter])."""
    sampler = _sampler(temp)
    runs = [None] + drafters
    best = [None] * len(runs)
    for _ in range(opts.repeat):
        for i, d in enumerate(runs):
            tokens, st, sp = measure.generation(engine, ids, n, sampler, opts.seed, d,
                                                strict=_strict(d, opts))
            if best[i] is None or st.decode_tps > best[i]["tps"]:
                best[i] = {"tps": st.decode_tps, "seconds": st.decode_seconds,
                           "decode_tokens": st.decode_tokens, "tokens": tokens, "spec": sp}
            step(_test_name(n, len(ids), temp) + (f" {d.name}" if d is not None else ""))
    return best[0], best[1:]
