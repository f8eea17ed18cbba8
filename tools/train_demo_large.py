#!/usr/bin/env python
"""Train the large demo target (issue #15): corpus, training (GPU or CPU, resumable), sharded export.

    python tools/train_demo_large.py corpus [--out runs/demo_large/data]        # CPU host, needs tokenizers
    python tools/train_demo_large.py train --workdir runs/demo_large/gpu --device auto --minutes 8.5
    python tools/train_demo_large.py export --workdir W --out DIR [--part 2/2]   # bf16 shards <= 15 MiB
    python tools/train_demo_large.py assemble --shards DIR [--out state.pt]      # back to a state dict

`train` resumes from <workdir>/ckpt.pt whenever it exists (model, optimizer, step, schedule, history);
batches depend only on (seed, step), so a resumed run draws the batches the uninterrupted one would.
On the GPU machine `train` needs only torch + numpy + the files written by `corpus`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "runs" / "demo_large" / "data"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("corpus", help="build the token files (CPU host; needs tokenizers)")
    c.add_argument("--out", type=Path, default=DEFAULT_DATA)
    c.add_argument("--vocab-size", type=int, default=16384)
    c.add_argument("--max-train-tokens", type=int, default=25_000_000,
                   help="cap on training tokens (uint16: 2 bytes each; the GPU carry budget is 64 MiB)")
    c.add_argument("--tokenizer-sample-bytes", type=int, default=40_000_000)

    t = sub.add_parser("train", help="train (or continue training) the target")
    t.add_argument("--workdir", type=Path, required=True, help="ckpt.pt, log.txt, metrics.json")
    t.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory written by `corpus`")
    t.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    t.add_argument("--minutes", type=float, default=None,
                   help="wall-clock budget of this invocation, everything included (stops cleanly, "
                        "checkpoints, evaluates and exports before it ends)")
    t.add_argument("--max-steps", type=int, default=None, help="stop this invocation at this step")
    t.add_argument("--total-steps", default="auto",
                   help="schedule length (cosine over it), fixed on the first run and kept in ckpt.pt; "
                        "auto: from --minutes and the measured step time of the first steps")
    t.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 262144 cuda, 2048 cpu); fixed on first run")
    t.add_argument("--seq", type=int, default=None, help="window length (default 1024 cuda, 256 cpu)")
    t.add_argument("--micro-batch", type=int, default=None, help="windows per forward (default 64 cuda, 4 cpu)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1.5e-3)")
    t.add_argument("--eval-every-min", type=float, default=None,
                   help="held-out evaluation period in minutes (default 2 cuda, 10 cpu)")
    t.add_argument("--ckpt-every-min", type=float, default=None, help="checkpoint period (default 3 cuda, 5 cpu)")
    t.add_argument("--eval-tokens", type=int, default=None,
                   help="held-out tokens scored per evaluation (default: all on cuda, 8192 on cpu)")
    t.add_argument("--export-reserve-s", type=float, default=None,
                   help="seconds of --minutes kept for the final checkpoint, evaluation and export")
    t.add_argument("--export-dir", type=Path, default=None,
                   help="copy part N of the shards (plus metrics.json, log.txt) here at the end ($OUT); "
                        "all parts are always written to <workdir>/export/part<N>/")
    t.add_argument("--export-part", default="1/2", help="N/M: which part of M goes to --export-dir")
    t.add_argument("--compile", action="store_true", help="torch.compile the model (off: startup time)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--seed", type=int, default=1234)

    e = sub.add_parser("export", help="bf16 shards (<= 15 MiB each) of the trained weights")
    e.add_argument("--workdir", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--part", default="1/1",
                   help="N/M: write only the shards of part N of M; all/M: every part into <out>/part<N>/")
    e.add_argument("--source", default="ckpt", choices=["ckpt", "final"],
                   help="weights from ckpt.pt (default) or final.pt")

    a = sub.add_parser("assemble", help="join shards (from one or more directories) into a state dict")
    a.add_argument("--shards", type=Path, nargs="+", required=True)
    a.add_argument("--out", type=Path, default=None, help="torch.save the state dict here")
    a.add_argument("--check", type=Path, default=None, help="compare with ckpt.pt's weights rounded to bf16")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmd == "corpus":
        from demo_large import corpus

        corpus.build(args.out, args.vocab_size, args.max_train_tokens, args.tokenizer_sample_bytes)
        return 0
    if args.cmd == "train":
        from demo_large.train import train

        train(args)
        return 0
    if args.cmd == "export":
        from demo_large import shards

        shards.export_from_workdir(args.workdir, args.out, args.part, args.source)
        return 0
    if args.cmd == "assemble":
        from demo_large import shards

        return shards.assemble_cli(args.shards, args.out, args.check)
    return 2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
