"""Fuzzing `inspect` (and `quantize --dry-run`) with a seeded mutator over a valid tiny GGUF.

Whatever the bytes, the commands end with exit code 0, 1 or 2, a failure is one line on stderr
naming the file, and nothing escapes as a traceback (or hangs on a lying header).
"""
import random
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.gguf_io import GGUFStreamWriter, check_header

N_CASES = 400
SEED = 20240611
_INTERESTING = (0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 255, 256, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
                2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1)


@pytest.fixture(scope="module")
def seed_file(tmp_path_factory):
    """A complete, valid one-layer llama GGUF of a few KB (several tensor and value types)."""
    path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
    rng = np.random.default_rng(0)
    n_embd, n_ff, n_vocab = 32, 64, 4
    shapes = {"token_embd.weight": ((n_vocab, n_embd), "Q8_0"), "output_norm.weight": ((n_embd,), "F32"),
              "output.weight": ((n_vocab, n_embd), "F16"), "blk.0.attn_norm.weight": ((n_embd,), "F32"),
              "blk.0.attn_q.weight": ((32, n_embd), "Q8_0"), "blk.0.attn_k.weight": ((16, n_embd), "F16"),
              "blk.0.attn_v.weight": ((16, n_embd), "BF16"), "blk.0.attn_output.weight": ((n_embd, 32), "Q4_0"),
              "blk.0.ffn_norm.weight": ((n_embd,), "F32"), "blk.0.ffn_gate.weight": ((n_ff, n_embd), "Q8_0"),
              "blk.0.ffn_up.weight": ((n_ff, n_embd), "Q8_0"), "blk.0.ffn_down.weight": ((n_embd, n_ff), "Q5_1")}
    with GGUFStreamWriter(path, "llama") as w:
        for key, value, vtype in (("llama.block_count", 1, V.UINT32), ("llama.context_length", 64, V.UINT32),
                                  ("llama.embedding_length", n_embd, V.UINT32),
                                  ("llama.feed_forward_length", n_ff, V.UINT32),
                                  ("llama.attention.head_count", 2, V.UINT32),
                                  ("llama.attention.head_count_kv", 1, V.UINT32),
                                  ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
                                  ("llama.rope.freq_base", 10000.0, V.FLOAT32),
                                  ("general.name", "fuzz seed", V.STRING), ("x.flag", True, V.BOOL),
                                  ("x.big", 2 ** 40, V.UINT64), ("tokenizer.ggml.model", "gpt2", V.STRING),
                                  ("tokenizer.ggml.pre", "gpt-2", V.STRING),
                                  ("tokenizer.ggml.bos_token_id", 3, V.UINT32)):
            w.add_key(key, value, vtype)
        w.add_key("tokenizer.ggml.tokens", ["a", "b", "ab", "<s>"], V.ARRAY, V.STRING)
        w.add_key("tokenizer.ggml.token_type", [1, 1, 1, 3], V.ARRAY, V.INT32)
        w.add_key("tokenizer.ggml.merges", ["a b"], V.ARRAY, V.STRING)
        for name, (shape, t) in shapes.items():
            w.add_tensor_info(name, shape, t)
        w.begin()
        for name, (shape, t) in shapes.items():
            w.write_tensor(name, formats.quantize(rng.standard_normal(shape).astype(np.float32), t))
    return path


def mutate(data: bytes, header_end: int, rnd: random.Random) -> bytes:
    b = bytearray(data)
    kind = rnd.random()
    if kind < 0.45:  # flip a few bits, mostly in the header
        for _ in range(rnd.randint(1, 6)):
            at = rnd.randrange(header_end if rnd.random() < 0.9 else len(b))
            b[at] ^= 1 << rnd.randrange(8)
    elif kind < 0.75:  # plant an interesting integer where a count, length or offset may be
        width = rnd.choice((4, 8))
        at = rnd.randrange(0, max(1, header_end - width))
        b[at:at + width] = struct.pack("<Q" if width == 8 else "<I",
                                       rnd.choice(_INTERESTING) & ((1 << (8 * width)) - 1))
    elif kind < 0.9:  # truncate
        del b[rnd.randrange(len(b)):]
    else:  # insert or delete a few bytes in the header
        at = rnd.randrange(header_end)
        if rnd.random() < 0.5:
            b[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 9)))
        else:
            del b[at:at + rnd.randint(1, 9)]
    return bytes(b)


def test_fuzzed_files_never_crash_inspect(seed_file, tmp_path):
    runner = CliRunner()
    data = seed_file.read_bytes()
    header_end = check_header(seed_file).data_start
    assert runner.invoke(main, ["inspect", str(seed_file)]).exit_code == 0
    rnd = random.Random(SEED)
    codes = {0: 0, 1: 0, 2: 0}
    for case in range(N_CASES):
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(mutate(data, header_end, rnd))
        for args in (["inspect", str(path)], ["inspect", "--json", "--tensors", str(path)],
                     ["quantize", str(path), "--type", "Q8_0", "--dry-run"]):
            r = runner.invoke(main, args)
            where = f"case {case} ({args[0]}): {r.output[-300:]!r}"
            assert r.exception is None or isinstance(r.exception, SystemExit), \
                f"{where}: {type(r.exception).__name__}: {r.exception}"
            assert r.exit_code in (0, 1, 2), where
            if r.exit_code:
                lines = r.stderr.splitlines()
                assert len(lines) >= 1 and lines[-1].startswith(f"ds4tools: {path}"), where
                assert len([x for x in lines if x.startswith("ds4tools: ")]) == 1, where
            if args[0] == "inspect" and len(args) == 2:
                codes[r.exit_code] += 1
        path.unlink()
    # the mutator reaches all three outcomes
    assert all(codes.values()), codes
