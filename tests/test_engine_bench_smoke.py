"""benchmarks/bench_engine.py still runs (tiny synthetic models), so it cannot rot."""
import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_engine.py"


def test_bench_engine_quick_run(capsys, tmp_path):
    main = runpy.run_path(str(BENCH), run_name="bench_engine")["main"]
    assert main(["--quick", "--models", "q8_0,q4_k_m", "--repeat", "1", "--dir", str(tmp_path),
                 "--no-llama-cpp"]) == 0
    out = capsys.readouterr().out
    assert "numpy memory copy:" in out
    for name in ("q8_0", "q4_k_m"):
        block = out.split(f"\n{name}: ")[1]
        for what in ("prefill", "decode", "t/s", "weights streamed", "r(k): 1:1.00", "16:", "one decode step",
                     "Python between kernels"):
            assert what in block, (name, what)
    assert "Q4_K" in out.split("\nq4_k_m: ")[1].split("\n")[1]  # the mix really ran
