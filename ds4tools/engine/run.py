"""What ``ds4tools run`` does, as a function the CLI calls (the CLI only parses options).

Output: the continuation streams to stdout as UTF-8 while it is generated, then a newline;
``--stats`` adds a summary on stderr; ``--json`` prints one JSON object instead:
``{"model", "text", "tokens", "stats": {prompt_tokens, generated_tokens, decode_tokens,
prefill_seconds, prefill_tps, decode_seconds, decode_tps, total_seconds, stop_reason, seed,
warmup_seconds, text_truncated}}``.
Errors are raised as ds4tools.errors classes (the CLI prints them and exits with their code).
"""
from __future__ import annotations

import json
import os
import sys

from ..errors import UsageError, about


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt with -p or -f, not both")
    if prompt_file is not None:
        try:
            with open(prompt_file, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise UsageError(about(prompt_file, e.strerror or str(e))) from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(about(prompt_file, f"not UTF-8 text (byte {e.start})")) from None
    if prompt is None:
        raise UsageError("no prompt: give one with -p PROMPT or -f FILE")
    return prompt


def run(*, model=None, prompt=None, prompt_file=None, n_predict=128, temp=0.8, top_k=40,
        top_p=0.95, min_p=0.05, seed=None, ctx=None, threads=None, cache_type="f32",
        exact=False, stats=False, as_json=False, spec=None, resolve_model=None, stdout=None,
        stderr=None, tp=None, device="cpu") -> int:
    """Run one generation; returns the exit code (0, or 130 when interrupted).

    ``spec``: a SpecConfig (the speculative-decoding flags), or None for plain decoding.
    ``resolve_model``: called as ``resolve_model(model, spec)`` once the request is checked and
    before anything loads, it returns the ``(model, spec)`` to run (the CLI passes
    ``ds4tools.demo.resolve_model``: without -m, the bundled demo and its draft files).
    ``tp``: the leader's ds4tools.tp session (tensor parallelism: the workers load their shards
    with the same options; MTP falls back to plain decoding). ``device``: "cpu" or "cuda"."""
    from .api import Engine, resolve_seed
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr
    text = read_prompt(prompt, prompt_file)
    if n_predict < 0:
        raise UsageError(f"-n {n_predict}: must not be negative")
    seed = resolve_seed(seed)  # a bad seed is refused before the model loads
    if spec is not None:
        spec = spec.resolved(temperature=temp)  # refuse wrong combinations before loading
    if resolve_model is not None:
        model, spec = resolve_model(model, spec)
    if tp is None:
        engine = Engine(model, n_ctx=ctx, threads=threads, cache_type=cache_type, exact=exact, spec=spec,
                        device=device)
    else:
        spec = tp.check_spec(spec, err)
        tp.start(dict(model=model, n_ctx=ctx, threads=threads, cache_type=cache_type, exact=exact))
        engine = tp.open_engine(lambda: Engine(model, n_ctx=ctx, threads=threads, cache_type=cache_type,
                                               exact=exact, spec=spec, tp=tp), err)
    if engine.drafter is not None:
        print(f"ds4tools: {engine.drafter.describe()}", file=err)
        if engine.spec.timing:
            engine.on_spec_step = _step_logger(err)
    pieces, ids = [], []
    code = 0
    tokens = engine.generate(text, n_predict, temperature=temp, top_k=top_k, top_p=top_p,
                             min_p=min_p, seed=seed)
    try:
        for tok in tokens:
            ids.append(tok.id)
            pieces.append(tok.text)
            if not as_json and tok.text:
                out.write(tok.text.encode("utf-8"))
                out.flush()
    except KeyboardInterrupt:
        tokens.close()  # completes the stats now: stop_reason "interrupted", the times
        # (an interrupt in the warm-up comes before the decoding loop that would say so)
        engine.last_stats.stop_reason = engine.last_stats.stop_reason or "interrupted"
        code = 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    st = engine.last_stats
    sp = engine.last_spec_stats
    if as_json:
        doc = {"model": engine.path, "text": "".join(pieces), "tokens": ids, "stats": st.as_dict()}
        if sp is not None:
            doc["stats"]["speculative"] = sp.as_dict()
        if tp is not None:
            doc["stats"]["tensor_parallel"] = tp.as_dict()
        out.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
    else:
        out.write(b"\n")
        if st.text_truncated:  # --json says so in stats.text_truncated
            print("ds4tools: generation stopped inside a multi-byte UTF-8 character: its first "
                  "bytes are not printed", file=err)
    out.flush()
    if stats:
        for line in (st.summary_lines() + (sp.summary_lines() if sp is not None else [])
                     + (tp.summary_lines() if tp is not None else [])):
            print(line, file=err)
    return code


def _step_logger(err):
    """--glm-mtp-timing: one stderr line per speculative step (ds4's mtp timing lines)."""
    last = {"draft": 0.0, "verify": 0.0}

    def log(spec, proposal, n_accepted, seconds):
        draft, verify = spec.draft_seconds - last["draft"], spec.target_verify_seconds - last["verify"]
        last["draft"], last["verify"] = spec.draft_seconds, spec.target_verify_seconds
        print(f"ds4tools: {spec.method} step {spec.steps}: drafted={len(proposal)} "
              f"accepted={n_accepted}{' cut' if proposal.cut else ''} draft={1e3 * draft:.3f} ms "
              f"verify={1e3 * verify:.3f} ms total={1e3 * seconds:.3f} ms", file=err)
    return log
