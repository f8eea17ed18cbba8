"""Run under ``mpiexec -n N python tests/tp_logits_check.py MODEL``: rank 0 compares the logits of
the sharded model with one process's, bit for bit, over a prefill, a verify batch after a
truncation, and single-token steps; prints one JSON line. (tests/test_tp.py runs it.)"""
import json
import sys

import numpy as np

from ds4tools.engine.api import Engine
from ds4tools.tp.session import TPSession, worker_main


def main(path: str) -> int:
    s = TPSession()
    opts = dict(n_ctx=128, threads=None, cache_type="f32", exact=False)
    if not s.leader:
        return worker_main(s, lambda o: Engine(path, tp=s, **opts))
    try:
        s.start(opts)
        tp = s.open_engine(lambda: Engine(path, tp=s, **opts))
        ref = Engine(path, **opts)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, ref.hparams.n_vocab, 40).tolist()
        same = []
        for start, rows in ((0, toks[:24]), (20, toks[20:29]), (29, toks[29:30]), (30, toks[30:31])):
            if start < ref.cache.length:
                ref.cache.truncate(start)
                tp.cache.truncate(start)
            a = ref.forward(rows, start, logits="all", hidden_layers=(1,), want_final_hidden=True)
            b = tp.forward(rows, start, logits="all", hidden_layers=(1,), want_final_hidden=True)
            same.append(bool(np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden[1], b.hidden[1])
                             and np.array_equal(a.final_hidden, b.final_hidden)))
        print(json.dumps({"identical": same, "shards": s.plan.as_dict()}), flush=True)
    finally:
        s.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
