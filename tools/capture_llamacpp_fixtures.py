#!/usr/bin/env python
"""Capture llama.cpp's outputs on the synthetic models into tests/fixtures/llamacpp/.

    python tools/capture_llamacpp_fixtures.py [FAMILY...]   # needs llama-cpp-python (0.3.36)

FAMILY: glm4moe, deepseek2, glm-dsa, deepseek4 (default: all). Building llama-cpp-python takes
longer than CI allows, so its answers are kept as small fixtures that the tests compare against
(tests/test_engine_<family>.py, a "-" in the name read as "_"). For every case of
tests/<family>_model.CASES it writes the GGUF (deterministic from the seed), runs llama.cpp in
a child process (float32 KV cache, no flash attention, one thread) and stores:

    <case>/prompt      the prompt's token ids (random, from PROMPT_SEED; N_PROMPT of them, or
                       the family module's own N_PROMPT: deepseek4's needs length for its
                       compressed attention)
    <case>/logits      float32 (n_prompt, n_vocab): the logits of every prompt position,
                       one batch
    <case>/greedy      int32 (N_GREEDY,): llama.cpp's greedy continuation, token by token
    <case>/digest      tests.llamacpp_families.weights_digest of the file it ran

in one compressed npz per family (<family>.npz). Rerun it after changing the synthetic
models (the tests refuse a fixture whose digest no longer matches the file they write).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import importlib  # noqa: E402

from tests.llamacpp_families import weights_digest  # noqa: E402

FAMILIES = ("glm4moe", "deepseek2", "glm-dsa", "deepseek4")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "llamacpp")
SEED = 0
PROMPT_SEED = 7
N_PROMPT = 12
N_GREEDY = 16

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp as L
    path, toks, n_greedy, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # its AMX / repacked buffers crash in some VMs; not needed here
    model = L.llama_model_load_from_file(path.encode(), mp)
    assert model, "llama.cpp did not load the model"
    cp = L.llama_context_default_params()
    n_batch = max(64, len(toks))
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, n_batch, n_batch, 1, 1
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def decode(tokens, start, all_logits):
        batch = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.logits[i] = 1 if all_logits or i == len(tokens) - 1 else 0
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert L.llama_decode(ctx, batch) == 0
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        res = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                        for i in rows])
        L.llama_batch_free(batch)
        return res

    logits = decode(toks, 0, True)
    greedy, last = [], logits[-1]
    for i in range(n_greedy):
        t = int(np.argmax(last))
        greedy.append(t)
        last = decode([t], len(toks) + i, False)[0]
    np.savez(out, logits=logits.astype(np.float32), greedy=np.array(greedy, np.int32))
    print("OK")
""")


def capture(family, case: str, workdir: str) -> dict:
    """family: the tests.<name>_model module."""
    path = os.path.join(workdir, f"{case}.gguf")
    family.write_case(path, case, SEED)
    cfg, _ = family.CASES[case]
    n_prompt = getattr(family, "N_PROMPT", N_PROMPT)
    prompt = np.random.default_rng(PROMPT_SEED).integers(0, cfg.n_vocab, n_prompt).astype(np.int32)
    out = os.path.join(workdir, f"{case}.npz")
    r = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(prompt.tolist()),
                        str(N_GREEDY), out], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or "OK" not in r.stdout:
        raise SystemExit(f"llama.cpp failed on {case} (rc {r.returncode}): {r.stderr[-2000:]}")
    got = np.load(out)
    return {f"{case}/prompt": prompt, f"{case}/logits": got["logits"], f"{case}/greedy": got["greedy"],
            f"{case}/digest": np.array(weights_digest(path))}


def main(argv: list[str]) -> int:
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown family {unknown[0]} (known: {', '.join(FAMILIES)})")
    for name in names:
        family = importlib.import_module(f"tests.{name.replace('-', '_')}_model")
        arrays = {}
        with tempfile.TemporaryDirectory() as tmp:
            for case in family.CASES:
                arrays.update(capture(family, case, tmp))
                print(f"{name} {case}: greedy {arrays[f'{case}/greedy'].tolist()}")
        os.makedirs(FIXTURES, exist_ok=True)
        out = os.path.join(FIXTURES, f"{name}.npz")
        np.savez_compressed(out, **arrays)
        print(f"wrote {out} ({os.path.getsize(out)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
