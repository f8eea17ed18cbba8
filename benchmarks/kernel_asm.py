"""Print what each format's int8 matmul kernel compiles to on this host (docs/engine.md's table).

    python benchmarks/kernel_asm.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds4tools import formats  # noqa: E402
from ds4tools.formats.kernel_asm import host_cpu, instruction_counts, kernel_assembly  # noqa: E402


def main():
    print(f"host: {host_cpu()}")
    print(f"{'format':8} {'act':5} instructions (count in the kernel)")
    for name, fmt in formats.FORMATS.items():
        if not fmt.has_int8_matmul:
            continue
        try:
            counts = instruction_counts(kernel_assembly(fmt))
        except TypeError as e:
            print(f"{name:8} {fmt.act_type:5} {e}")
            continue
        listing = ", ".join(f"{op} x{n}" for op, n in counts.most_common()) or "none"
        print(f"{name:8} {fmt.act_type:5} {listing}")


if __name__ == "__main__":
    main()
