"""benchmarks/bench_formats.py still runs (tiny sizes, every registered format), so it cannot rot."""
import runpy
from pathlib import Path

from ds4tools import formats

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_formats.py"


def test_bench_formats_quick_run(capsys):
    main = runpy.run_path(str(BENCH), run_name="bench_formats")["main"]
    assert main(["--quick", "--sizes", "8x512"]) == 0
    out = capsys.readouterr().out
    for name in formats.FORMATS:
        lines = [line for line in out.splitlines() if line.startswith(f"{name} ")]
        assert len(lines) == 1 and "quantize" in lines[0] and "GB/s" in lines[0], (name, out)
    stripped = [line.strip() for line in out.splitlines()]
    assert sum(line.startswith("dequantize ") for line in stripped) == len(formats.FORMATS)
    assert sum(line.startswith("matvec fused ") for line in stripped) == len(formats.FORMATS)
    assert sum(line.startswith("matvec weights read at ") and "x memcpy" in line and "16:" in line
               for line in stripped) == len(formats.FORMATS)
    assert "vs ggml 2-thread" in out and "# numpy memory copy:" in out


def test_bench_formats_matvec_from_memory(capsys):
    # --cache-mib 1: copies of the matrix that fill 2 MiB, so the path runs on a tiny matrix
    main = runpy.run_path(str(BENCH), run_name="bench_formats")["main"]
    assert main(["--quick", "--sizes", "64x512", "--formats", "Q4_K,F16", "--matvec-only",
                 "--cache-mib", "1"]) == 0
    out = capsys.readouterr().out
    read = [line for line in out.splitlines() if "matvec weights read at" in line]
    assert len(read) == 2 and all("copies cycled)" in line and line.count("x memcpy") == 2
                                  for line in read), out
    assert "last-level cache 1 MiB" in out
    # the baseline: ggml_mul_mat through ctypes, from ggml-python's library (the `test` extra)
    # where llama-cpp-python is absent; its result agrees with ours
    ggml_lines = [line for line in out.splitlines()
                  if "ggml_mul_mat (" in line and not line.startswith("#")]
    assert len(ggml_lines) == 2 and all("from memory" in line for line in ggml_lines), out
    for line in ggml_lines:
        assert float(line.rsplit("max |y| ", 1)[1].rstrip(")")) < 0.05, line


def test_bench_formats_rejects_a_bad_size():
    main = runpy.run_path(str(BENCH), run_name="bench_formats")["main"]
    try:
        main(["--quick", "--sizes", "8by512"])
    except SystemExit as e:
        assert "bad size '8by512'" in str(e)
    else:
        raise AssertionError("a malformed --sizes must stop the benchmark")
