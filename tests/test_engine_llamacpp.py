"""The engine against llama.cpp itself (through llama-cpp-python's library) on the same GGUF files:
the same logits, so the files mean to us what they mean to llama.cpp (rope pairing, norms, GQA,
tied output). llama.cpp runs in a child process with float32 weights and a float32 KV cache."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ds4tools.engine import Engine
from tests.reference_model import RefConfig, write_random_model

try:
    import llama_cpp  # noqa: F401
    HAVE_LLAMA_CPP = True
except ImportError:
    HAVE_LLAMA_CPP = False

pytestmark = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed: "
                                "the cross-check against llama.cpp needs its library")

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp as L
    path, toks, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # its AMX / repacked buffers crash in some VMs; not needed here
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 64, 64, 1, 1
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    n = len(toks)
    batch = L.llama_batch_init(n, 0, 1)
    for i, t in enumerate(toks):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = n
    assert L.llama_decode(ctx, batch) == 0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in range(n)]
    np.save(out, np.stack(rows))
    print("OK")
""")


def llama_cpp_logits(path, tokens, tmp_path) -> np.ndarray:
    out = tmp_path / "logits.npy"
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps([int(t) for t in tokens]), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, f"llama.cpp child failed (rc {r.returncode}): {r.stderr[-1500:]}"
    return np.load(out)


# (model, options, weight type, tolerance): with F16 weights llama.cpp also rounds the
# activations to fp16 (its vec_dot_type for F16), hence the looser bound there.
CASES = {
    "qwen3": (RefConfig("qwen3", 300, 256, 2, 4, 2, 64, 512), {}, "F32", 1e-4),
    "llama-tied": (RefConfig("llama", 300, 256, 2, 4, 2, 64, 512), {"tied": True}, "F32", 1e-4),
    "llama-f16": (RefConfig("llama", 300, 256, 2, 8, 2, 32, 512), {}, "F16", 2e-3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_llama_cpp(case, tmp_path):
    cfg, kw, fmt, tol = CASES[case]
    path = tmp_path / f"{case}.gguf"
    write_random_model(path, cfg, seed=31, default_type=fmt, **kw)
    tokens = np.random.default_rng(32).integers(0, cfg.n_vocab, 20)
    ours = Engine(path, exact=True).forward(tokens, 0).logits
    theirs = llama_cpp_logits(path, tokens, tmp_path)
    assert theirs.shape == ours.shape
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err < tol, err
    assert (ours.argmax(1) == theirs.argmax(1)).all()


def test_converted_hf_checkpoint_matches_llama_cpp(gguf_llama_f32, tmp_path):
    eng = Engine(gguf_llama_f32, exact=True)
    tokens = eng.tokenize("the model reads a token and writes the next one")
    ours = eng.forward(tokens, 0).logits
    theirs = llama_cpp_logits(gguf_llama_f32, tokens, tmp_path)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4
