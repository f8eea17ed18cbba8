"""Corrupt tensor data (NaN / Inf from flipped bytes) never gives a Python traceback: a forward
that produces non-finite logits stops `ds4tools run` with one line naming the file, exit 1, in
every decoding mode and on both matmul paths."""
import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.engine.transformer import NonFiniteLogits
from tests.reference_model import (RefConfig, byte_level_tokenizer_metadata, config_metadata,
                                   random_weights, write_gguf)

CFG = RefConfig("llama", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
MESSAGE = "the forward produced non-finite logits (NaN or Inf): the weights are corrupt or overflow float32"


def _corrupt(src, dst, tensor, payload: bytes, at: int = 0):
    """Copy src to dst with ``payload`` written over tensor's data at byte ``at``."""
    offset = next(t.data_offset for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor)
    data = bytearray(src.read_bytes())
    data[offset + at:offset + at + len(payload)] = payload
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-weights")
    meta = config_metadata(CFG) | byte_level_tokenizer_metadata(CFG.n_vocab)
    w = random_weights(CFG, np.random.default_rng(3))
    write_gguf(d / "f32.gguf", "llama", meta, w)
    write_gguf(d / "q8_0.gguf", "llama", meta, w, default_type="Q8_0")
    nan_inf = np.array([np.nan, np.inf], np.float32).tobytes()  # 8 bytes
    return {
        "attn_norm": _corrupt(d / "f32.gguf", d / "norm.gguf", "blk.1.attn_norm.weight", nan_inf),
        "ffn_up": _corrupt(d / "f32.gguf", d / "up.gguf", "blk.1.ffn_up.weight", nan_inf, at=64),
        # a Q8_0 block scale set to the fp16 NaN pattern: every weight of the block is NaN
        "q8_0 scale": _corrupt(d / "q8_0.gguf", d / "q8.gguf", "blk.0.ffn_down.weight", b"\xff\x7e"),
        "clean": d / "q8_0.gguf",
    }


@pytest.mark.parametrize("which", ["attn_norm", "ffn_up", "q8_0 scale"])
@pytest.mark.parametrize("args", [["--temp", "0"], ["--temp", "0.8", "--seed", "1"],
                                  ["--temp", "0", "--lookup", "3"], ["--temp", "0", "--exact"]])
def test_run_stops_with_one_line(models, which, args):
    r = CliRunner().invoke(main, ["run", "-m", str(models[which]), "-p", "ab ab ab ab", "-n", "8", *args])
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("ds4tools: lookup:")]
    assert lines == [f"ds4tools: {models[which]}: {MESSAGE}"]
    assert "Traceback" not in r.output


def test_engine_forward_raises_a_typed_error(models):
    with Engine(models["attn_norm"]) as eng:
        with pytest.raises(NonFiniteLogits):
            eng.forward([1, 2, 3], 0, logits="last")


def test_clean_model_still_runs(models):
    r = CliRunner().invoke(main, ["run", "-m", str(models["clean"]), "-p", "ab", "-n", "4", "--temp", "0"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", [n for n, f in formats.FORMATS.items() if f.has_int8_matmul])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_int8_path_keeps_non_finite_activations_visible(name, bad):
    # quantizing activations must not round a NaN / Inf into finite int8 values
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(5)
    n = 2 * max(256, fmt.block_size)
    w = rng.standard_normal((3, n)).astype(np.float32)
    raw = formats.quantize(w, name, imatrix=np.ones(n, np.float32) if fmt.requires_imatrix else None)
    x = rng.standard_normal((2, n)).astype(np.float32)
    x[1, 7] = bad
    y = formats.matmul(raw, name, w.shape, x, int8=True)
    assert np.isfinite(y[0]).all() and not np.isfinite(y[1]).any()
