"""The ``ds4tools bench`` table: llama-bench's markdown layout (model, format, size, params,
threads, test, t/s) with this project's columns (matmul path, GB/s of weights, r(k), and for a
drafter sweep the setting, speedup, tau and alpha). Columns no row fills are left out."""
from __future__ import annotations

import os


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def _formats(model: dict) -> str:
    fm = model["formats"]
    total = sum(f["bytes"] for f in fm) or 1
    if len(fm) == 1:
        return fm[0]["type"]
    return " ".join(f"{f['type']} {100 * f['bytes'] / total:.0f}%" for f in fm
                    if f["bytes"] / total >= 0.005)


def _rows(doc: dict) -> list[dict]:
    rows = [{"test": r["test"], "t/s": f"{r['tps']:.2f}"} for r in doc["pp"]]
    for r in doc["tg"]:
        rows.append({"test": r["test"], "t/s": f"{r['tps']:.2f}", "GB/s": f"{r['weight_gbps']:.2f}",
                     **({"spec": "plain"} if doc["spec"] else {})})
    for r in doc["rk"]:
        rows.append({"test": r["test"], "t/s": f"{r['tps']:.2f}", "r(k)": f"{r['r']:.2f}"})
    shown_plain = {r["test"] for r in doc["tg"]}
    for r in doc["spec"]:
        if r["test"] not in shown_plain:  # a sampled baseline (greedy ones are the tg rows)
            shown_plain.add(r["test"])
            rows.append({"test": r["test"], "spec": "plain", "t/s": f"{r['plain_tps']:.2f}",
                         "speedup": "1.00"})
        rows.append({"test": r["test"], "spec": r["setting"], "t/s": f"{r['tps']:.2f}",
                     "speedup": f"{r['speedup']:.2f}", "tau": f"{r['tau']:.2f}",
                     "alpha": f"{r['alpha']:.2f}"})
    return rows


COLUMNS = ("model", "format", "size", "params", "matmul", "threads", "test", "spec", "t/s", "GB/s",
           "r(k)", "speedup", "tau", "alpha")
LEFT = {"model", "format", "matmul", "spec"}


def render_table(doc: dict) -> str:
    m, sy = doc["model"], doc["system"]
    name = os.path.basename(m["path"])
    if m.get("demo"):
        name = "demo (bundled)"
    common = {"model": name[:-5] if name.endswith(".gguf") else name, "format": _formats(m),
              "size": _size(m["size_bytes"]), "params": _count(m["params"]),
              "matmul": "f32" if doc["settings"]["exact"] or not m["int8_matmuls"] else "int8",
              "threads": str(sy["threads"])}
    rows = [{**common, **r} for r in _rows(doc)]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in cols}

    def line(cells):
        return "| " + " | ".join(cells[c].ljust(widths[c]) if c in LEFT else cells[c].rjust(widths[c])
                                 for c in cols) + " |"
    out = [line({c: c for c in cols}),
           "| " + " | ".join(("-" * (widths[c] - 1) + ":") if c not in LEFT else "-" * widths[c]
                             for c in cols) + " |"]
    out += [line({c: r.get(c, "") for c in cols}) for r in rows]
    st = doc["settings"]
    out.append("")
    out.append(f"memcpy {sy['memcpy_gbps']:.2f} GB/s (numpy copy, bytes read per second, this run); "
               f"a decode step reads {_size(m['weight_bytes_per_token'])} of weights (GB/s column)")
    if sy["single_thread_kernels"]:
        out.append("this model's matrices are so small that its short batches run on one "
                   "thread, whatever --threads says (or, up to 1 MiB, the CPUs were busy: "
                   "docs/engine.md)")
    if doc["rk"]:
        out.append(f"r(k) = time of a k-token forward / time of a 1-token forward, at depth "
                   f"{st['depth']}; {'synthetic' if st['prompt'] == 'synthetic' else 'text'} prompt of "
                   f"{st['prompt_tokens']} tokens; best of {st['repeat']}")
    if doc["spec"]:
        out.append("speedup = decode t/s over plain decoding's (same prompt, seed and tokens, "
                   "this run); tau = tokens per verify step; alpha = accepted / verified drafts")
    return "\n".join(out)
