"""The `ds4tools` command line: a thin layer over the library.

Every error is one line on stderr, ``ds4tools: <file>: <problem>``, and an exit code:
0 success, 1 the input was read but is invalid, 2 it cannot be read or the usage is wrong.
"""
import contextlib
import json
import signal
import sys

import click

from . import __version__
from .errors import Ds4Error, UsageError


@contextlib.contextmanager
def _reported_errors():
    try:
        yield
    except Ds4Error as e:
        click.echo(f"ds4tools: {e}", err=True)
        sys.exit(e.exit_code)
    except OSError as e:  # a disk that fills up, a folder without write permission...
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        click.echo(f"ds4tools: {where}{e.strerror or e}", err=True)
        sys.exit(2)
    except MemoryError:
        click.echo("ds4tools: out of memory", err=True)
        sys.exit(1)


class Terminated(BaseException):
    """SIGTERM, raised where the program is so that its clean-ups run (``finally``, a
    quantize's ``except BaseException`` that removes its temporary file): Python's default
    SIGTERM action ends the process without them."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _interrupts():
    """Ctrl-C and SIGTERM end a command after its clean-ups with one line and the shell's
    codes, 130 and 143 (not click's "Aborted!" and 1)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not in the main thread (an embedding program): leave SIGTERM alone
        previous = None
    try:
        yield
    except KeyboardInterrupt:
        click.echo("ds4tools: interrupted", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("ds4tools: terminated", err=True)
        sys.exit(143)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ds4tools")
def main():
    """GGUF quantizer, inspector and numba engine with lossless speculative decoding."""


@main.command()
@click.argument("src", type=click.Path())
@click.option("-o", "--output", "out", type=click.Path(), metavar="OUT.gguf",
              help="Output GGUF (required unless --dry-run).")
@click.option("--type", "type_", metavar="TYPE",
              help="A llama.cpp mix (Q4_K_M, Q8_0, Q2_K, IQ2_XXS...), ds4's DeepSeek V4 mix DS4_Q2, "
                   "or any tensor type (required; Q8_0 by default with --dspark-out).")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="REGEX=TYPE",
              help="Type for tensors whose name matches REGEX (partial match, first wins).")
@click.option("--output-tensor-type", metavar="TYPE", help="Type of output.weight.")
@click.option("--token-embedding-type", metavar="TYPE", help="Type of token_embd.weight.")
@click.option("--pure", is_flag=True, help="No mix rules: every weight gets TYPE.")
@click.option("--imatrix", type=click.Path(), metavar="FILE",
              help="llama.cpp importance matrix (GGUF or .dat).")
@click.option("--threads", type=int, metavar="N", help="CPU threads for the kernels.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dry-run", is_flag=True, help="Print the per-tensor plan; write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--keep-nextn", is_flag=True,
              help="Embed the checkpoint's NextN layer in OUT (blk.L.nextn.*), as llama.cpp does for GLM/DeepSeek.")
@click.option("--mtp-out", type=click.Path(), metavar="MTP.gguf",
              help="Also write the MTP support GGUF from the source's NextN layer (DeepSeek/GLM "
                   "checkpoints: llama.cpp's MTP-only file, and OUT without the NextN layer).")
@click.option("--only-support", is_flag=True, help="Write only the support file (no -o).")
@click.option("--dspark-out", type=click.Path(), metavar="DRAFT.gguf",
              help="Write the DSpark draft of the DSpark checkpoint SRC (needs --target).")
@click.option("--target", metavar="TARGET",
              help="The target model (Hugging Face directory or GGUF) of --dspark-out.")
@click.option("--layout", type=click.Choice(["llama.cpp", "ds4"]),
              help="DSpark draft layout (default: llama.cpp for qwen3/llama, ds4 for DeepSeek V4).")
@click.option("--dspark-block-size", type=int, metavar="N", help="Block size (at most the trained one).")
@click.option("--dspark-target-layers", metavar="A,B,C",
              help="Target layers whose outputs feed the draft (default: the checkpoint's).")
@click.option("--dspark-markov-rank", type=int, metavar="R", help="Markov rank (checked against the checkpoint).")
@click.option("--dspark-noise-token-id", type=int, metavar="ID", help="Mask/noise token id.")
def quantize(src, out, type_, tensor_types, output_tensor_type, token_embedding_type, pure,
             imatrix, threads, device, dry_run, overwrite, keep_nextn, mtp_out, only_support,
             dspark_out, target, layout, dspark_block_size, dspark_target_layers,
             dspark_markov_rank, dspark_noise_token_id):
    """Quantize a GGUF, or convert a Hugging Face directory, to OUT.gguf (and support GGUFs:
    --mtp-out, --dspark-out)."""
    from .quantize import QuantizeOptions, quantize_model
    with _interrupts(), _reported_errors():
        if type_ is None:
            if not dspark_out:
                raise UsageError("missing option --type TYPE")
            type_ = "Q8_0"
        opts = QuantizeOptions(type_, pure=pure, output_tensor_type=output_tensor_type,
                               token_embedding_type=token_embedding_type,
                               tensor_types=list(tensor_types), imatrix=imatrix, threads=threads,
                               device=device, dry_run=dry_run, overwrite=overwrite,
                               keep_nextn=keep_nextn, mtp_out=mtp_out, only_support=only_support,
                               dspark_out=dspark_out, target=target, layout=layout,
                               dspark_block_size=dspark_block_size,
                               dspark_target_layers=_int_list(dspark_target_layers,
                                                              "--dspark-target-layers"),
                               dspark_markov_rank=dspark_markov_rank,
                               dspark_noise_token_id=dspark_noise_token_id)
        result = quantize_model(src, out, opts, report=lambda msg: click.echo(msg, err=True))
    click.echo(result.summary)


def _int_list(text, option: str):
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected comma-separated integers") from None


@main.command("inspect")
@click.argument("file", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON document (schema in docs/cli.md).")
@click.option("--tensors", is_flag=True, help="Add the tensor table and totals by type.")
@click.option("--keys", metavar="PATTERN", help="Only metadata keys matching this regex.")
@click.option("--target", metavar="MODEL",
              help="Check a support GGUF against its target model (GGUF or Hugging Face directory).")
def inspect_cmd(file, as_json, tensors, keys, target):
    """Describe and validate a GGUF file (a split set is read from any of its shards)."""
    from .inspect import inspect_file, render_text
    with _interrupts(), _reported_errors():
        doc = inspect_file(file, tensors=tensors, keys=keys, target=target)
    click.echo(json.dumps(doc, indent=2, ensure_ascii=False) if as_json else render_text(doc))
    if not doc["valid"]:
        errors = [x["message"] for x in doc["findings"] if x["level"] == "error"]
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        click.echo(f"ds4tools: {file}: {errors[0]}{more}", err=True)
        sys.exit(1)


@main.command("run")
@click.option("-m", "--model", type=click.Path(), metavar="MODEL.gguf",
              help="Model to run (default: the bundled demo model, prepared on first use).")
@click.option("-p", "--prompt", metavar="PROMPT", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(), metavar="FILE",
              help="Read the prompt from FILE (UTF-8).")
@click.option("-n", "--n-predict", "n_predict", type=int, default=128, show_default=True,
              metavar="N", help="Tokens to generate at most.")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Temperature; 0 is greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Top-k (0: off).")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="Top-p (1: off).")
@click.option("--min-p", type=float, default=0.05, show_default=True, help="Min-p (0: off).")
@click.option("--seed", type=int, metavar="S",
              help="Random seed; -1 (the default) draws a fresh one, which --stats / --json report.")
@click.option("--ctx", type=int, metavar="N", help="Context size in tokens (default: the model's, at most 4096).")
@click.option("--threads", type=int, metavar="N", help="CPU threads for the kernels.")
@click.option("--cache-type", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
              help="KV cache storage.")
@click.option("--exact", is_flag=True, help="Float32 activations in every matmul (no int8 path).")
@click.option("--stats", is_flag=True,
              help="Print token counts and speeds to stderr (and drafting statistics).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, stats).")
@click.option("--mtp", "mtp_file", type=click.Path(), metavar="FILE",
              help="Support GGUF to draft with: an MTP head (ds4's mtp.0.* layout), or with "
                   "--dspark a DSpark draft. Checked against the model at load.")
@click.option("--mtp-draft", type=int, metavar="N",
              help="MTP: most autoregressive drafts per step, 1..16 [default: 3].")
@click.option("--mtp-margin", type=float, metavar="F",
              help="MTP: stop drafting at the first draft whose top-1 minus top-2 logit is "
                   "below F [default: 0 = off; ds4 uses 3 on DeepSeek V4's logit scale].")
@click.option("--glm-mtp", is_flag=True,
              help="Draft with the NextN layer embedded in the model GGUF (no --mtp file).")
@click.option("--glm-mtp-timing", is_flag=True,
              help="Per-step timing and acceptance on stderr (alone, implies --glm-mtp).")
@click.option("--dspark", is_flag=True,
              help="Draft with the DSpark draft given with --mtp (without -m: the demo's).")
@click.option("--dspark-block-size", type=int, metavar="N",
              help="DSpark: most drafts per block, at most the trained block [default: trained].")
@click.option("--dspark-confidence", type=float, metavar="F",
              help="DSpark: cut the block at the first position whose confidence is below F, "
                   "0..1 [default: 0 = no cut]. Decided before verification: lossless.")
@click.option("--dspark-strict", is_flag=True,
              help="DSpark: commit a block only if every draft is accepted, else only its first "
                   "token. Lossless at --temp 0 only; refused with sampling.")
@click.option("--lookup", type=int, metavar="N",
              help="Prompt lookup: draft up to N tokens copied after the latest earlier match of "
                   "the last 3/2/1 tokens (no model).")
@click.option("--tp", type=int, metavar="N",
              help="Tensor parallelism over N processes (mpiexec; needs the tp extra). Under "
                   "mpiexec -n N the processes join that world (docs/engine.md).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the model runs: cuda keeps weights (in their GGUF formats), cache and "
                   "activations on an NVIDIA GPU (the cuda extra; every architecture but deepseek4 "
                   "so far).")
def run_cmd(model, prompt, prompt_file, n_predict, temp, top_k, top_p, min_p, seed, ctx, threads,
            cache_type, exact, stats, as_json, mtp_file, mtp_draft, mtp_margin, glm_mtp,
            glm_mtp_timing, dspark, dspark_block_size, dspark_confidence, dspark_strict, lookup,
            tp, device):
    """Generate a continuation of a prompt (printed as it comes, without the prompt).

    Speculative decoding (lossless: greedy output is token-identical to plain decoding, sampled
    output has the same distribution) drafts with an MTP head (--mtp FILE, --glm-mtp), a DSpark
    draft (--mtp FILE --dspark) or prompt lookup (--lookup N)."""
    from .demo import resolve_model
    from .engine.run import run
    from .engine.speculative.config import SpecConfig
    spec = SpecConfig(mtp_file=mtp_file, glm_mtp=glm_mtp, dspark=dspark, mtp_draft=mtp_draft,
                      mtp_margin=mtp_margin, dspark_block_size=dspark_block_size,
                      dspark_confidence=dspark_confidence, dspark_strict=dspark_strict,
                      lookup=lookup, timing=glm_mtp_timing)
    from .tp.session import world_size_from_env
    kwargs = dict(model=model, prompt=prompt, prompt_file=prompt_file, n_predict=n_predict,
                  temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, ctx=ctx,
                  threads=threads, cache_type=cache_type, exact=exact, stats=stats,
                  as_json=as_json, spec=spec if spec.active else None,
                  resolve_model=resolve_model, device=device)
    with _interrupts(), _reported_errors():  # run itself exits 130 when generation is interrupted
        if tp is not None and tp < 1:
            raise UsageError(f"--tp {tp}: must be at least 1")
        if device != "cpu" and (tp is not None and tp > 1 or world_size_from_env() > 1):
            raise UsageError(f"--device {device} and --tp: tensor parallelism runs on the CPU so far")
        if world_size_from_env() > 1:  # one rank of an MPI world: tensor parallelism
            from .tp.launch import run_rank
            code = run_rank(tp, kwargs)
        elif tp is not None and tp > 1:  # start the ranks
            from .tp.launch import launch
            code = launch(tp, sys.argv[1:], threads)
        else:
            code = run(**kwargs)
    sys.exit(code)


@main.command("serve")
@click.option("-m", "--model", type=click.Path(), metavar="MODEL.gguf",
              help="Model to serve (default: the bundled demo model, prepared on first use).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port (0: any free port).")
@click.option("--api-key", metavar="KEY", envvar="DS4TOOLS_API_KEY",
              help="Require 'Authorization: Bearer KEY' (also $DS4TOOLS_API_KEY).")
@click.option("--ctx", type=int, metavar="N", help="Context size per slot (default: the model's, at most 4096).")
@click.option("--parallel", type=int, default=1, show_default=True, metavar="N",
              help="Slots: requests generated at once, each with its own cache.")
@click.option("--queue", "queue_size", type=int, default=16, show_default=True, metavar="N",
              help="Requests that may wait for a slot; past that, 503 with Retry-After.")
@click.option("--alias", metavar="NAME", help="Model name in the API (default: the file's name).")
@click.option("--chat-template-file", type=click.Path(), metavar="FILE",
              help="Jinja2 chat template to use instead of the model's tokenizer.chat_template.")
@click.option("--threads", type=int, metavar="N", help="CPU threads per slot for the kernels.")
@click.option("--cache-type", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
              help="KV cache storage.")
@click.option("--exact", is_flag=True, help="Float32 activations in every matmul (no int8 path).")
@click.option("--mtp", "mtp_file", type=click.Path(), metavar="FILE",
              help="Support GGUF to draft with: an MTP head, or with --dspark a DSpark draft.")
@click.option("--mtp-draft", type=int, metavar="N", help="MTP: most drafts per step, 1..16 [default: 3].")
@click.option("--mtp-margin", type=float, metavar="F", help="MTP: top-1 minus top-2 logit floor [default: 0 = off].")
@click.option("--glm-mtp", is_flag=True, help="Draft with the NextN layer embedded in the model GGUF.")
@click.option("--dspark", is_flag=True, help="Draft with the DSpark draft given with --mtp (without -m: the demo's).")
@click.option("--dspark-block-size", type=int, metavar="N", help="DSpark: most drafts per block.")
@click.option("--dspark-confidence", type=float, metavar="F", help="DSpark: confidence cut, 0..1 [default: 0].")
@click.option("--dspark-strict", is_flag=True,
              help="DSpark strict acceptance (lossless at temperature 0 only: sampled requests get 400).")
@click.option("--lookup", type=int, metavar="N", help="Prompt lookup: draft up to N tokens (no model).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True, help="uvicorn's log level.")
def serve_cmd(model, host, port, api_key, ctx, parallel, queue_size, alias, chat_template_file,
              threads, cache_type, exact, mtp_file, mtp_draft, mtp_margin, glm_mtp, dspark,
              dspark_block_size, dspark_confidence, dspark_strict, lookup, log_level):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics), drafting losslessly with the speculative flags of `run`.
    Needs the `serve` extra."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError as e:
        click.echo(f"ds4tools: serve needs the serve extra ({e.name} is missing): "
                   f"pip install 'ds4tools[serve]'", err=True)
        sys.exit(2)
    from .demo import resolve_model
    from .engine.speculative.config import SpecConfig
    from .serve import ServeOptions, serve
    spec = SpecConfig(mtp_file=mtp_file, glm_mtp=glm_mtp, dspark=dspark, mtp_draft=mtp_draft,
                      mtp_margin=mtp_margin, dspark_block_size=dspark_block_size,
                      dspark_confidence=dspark_confidence, dspark_strict=dspark_strict, lookup=lookup)
    opts = ServeOptions(model=model, host=host, port=port, api_key=api_key, ctx=ctx, parallel=parallel,
                        queue=queue_size, threads=threads, cache_type=cache_type, exact=exact,
                        alias=alias, chat_template_file=chat_template_file,
                        spec=spec if spec.active else None, log_level=log_level)
    # uvicorn stops gracefully on Ctrl-C / SIGTERM, then re-raises the signal: exit 130 / 143
    with _interrupts(), _reported_errors():
        code = serve(opts, resolve_model=resolve_model)
    sys.exit(code)


@main.command("bench")
@click.option("-m", "--model", type=click.Path(), metavar="MODEL.gguf",
              help="Model to measure (default: the bundled demo model).")
@click.option("-p", "--n-prompt", "n_prompt", metavar="N[,N...]",
              help="Prompt sizes of the prefill tests (pp); 0: none [default: 512, or the "
                   "--prompt's length].")
@click.option("-n", "--n-gen", "n_gen", metavar="N[,N...]",
              help="Tokens of the decode tests (tg) and the sweep; 0: none [default: 128].")
@click.option("--rk", metavar="K[,K...]", help="Verify-cost curve r(k) [default: 1,2,4,8,16].")
@click.option("-t", "--threads", type=int, metavar="N", help="CPU threads for the kernels.")
@click.option("-r", "--repeat", type=int, metavar="N", help="Best of N runs [default: 3].")
@click.option("--prompt", metavar="TEXT",
              help="Prompt text (tiled or cut to -p tokens) [default: synthetic token ids].")
@click.option("-f", "--file", "prompt_file", type=click.Path(), metavar="FILE",
              help="Read the prompt text from FILE (UTF-8).")
@click.option("--exact", is_flag=True, help="Float32 activations in every matmul (no int8 path).")
@click.option("--cache-type", type=click.Choice(["f32", "f16"]), default="f32", show_default=True,
              help="KV cache storage.")
@click.option("--temp", metavar="T[,T...]",
              help="Temperatures of the drafter sweep (no top-k/p, min-p) [default: 0].")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seed of sampled sweeps.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (schema in docs/cli.md).")
@click.option("--mtp", "mtp_file", type=click.Path(), metavar="FILE",
              help="MTP head to sweep, or with --dspark the DSpark draft.")
@click.option("--mtp-draft", metavar="N[,N...]", help="MTP draft depths to sweep (1..16).")
@click.option("--mtp-margin", metavar="F[,F...]", help="MTP margins to sweep.")
@click.option("--glm-mtp", is_flag=True, help="Sweep MTP with the NextN layer inside the model.")
@click.option("--dspark", is_flag=True, help="Sweep DSpark (draft: --mtp FILE, or the demo's).")
@click.option("--dspark-block-size", metavar="N[,N...]", help="DSpark block sizes to sweep.")
@click.option("--dspark-confidence", metavar="F[,F...]", help="DSpark confidence cuts to sweep.")
@click.option("--dspark-strict", is_flag=True, help="DSpark strict acceptance (greedy only).")
@click.option("--lookup", metavar="N[,N...]", help="Prompt-lookup draft lengths to sweep.")
def bench_cmd(model, n_prompt, n_gen, rk, threads, repeat, prompt, prompt_file, exact, cache_type,
              temp, seed, as_json, mtp_file, mtp_draft, mtp_margin, glm_mtp, dspark,
              dspark_block_size, dspark_confidence, dspark_strict, lookup):
    """Measure prefill and decode t/s, weight GB/s against a memory copy, the verify-cost curve
    r(k), and with drafter options a speculative sweep (speedup, tau, alpha per setting).
    Comma lists sweep, as in llama-bench: --lookup 4,8 --mtp-draft 1,2,3."""
    from .bench import BenchOptions, render_table, run_bench
    with _reported_errors():
        opts = BenchOptions.from_cli(
            model=model, n_prompt=n_prompt, n_gen=n_gen, rk=rk, threads=threads, repeat=repeat,
            prompt=prompt, prompt_file=prompt_file, exact=exact, cache_type=cache_type, temp=temp,
            seed=seed, mtp_file=mtp_file, glm_mtp=glm_mtp, dspark=dspark, mtp_draft=mtp_draft,
            mtp_margin=mtp_margin, dspark_block_size=dspark_block_size,
            dspark_confidence=dspark_confidence, dspark_strict=dspark_strict, lookup=lookup)
        doc = run_bench(opts)
    click.echo(json.dumps(doc, indent=2) if as_json else render_table(doc))


@main.command("distill")
@click.argument("target", type=click.Path())
@click.option("--kind", metavar="dspark|mtp", help="What to train: a DSpark block draft or an MTP head.")
@click.option("-o", "--output", "out", type=click.Path(), metavar="OUT.gguf",
              help="The draft to write (a JSON report is written beside it: OUT.distill.json).")
@click.option("--data", multiple=True, type=click.Path(), metavar="PATH",
              help="Text files or folders (read recursively) of training text and prompts; repeatable.")
@click.option("--self-generate", type=int, default=0, show_default=True, metavar="N",
              help="Also train on N continuations the target writes from prompts of --data "
                   "(half greedy, half T = 1): self-distillation.")
@click.option("--block-size", type=int, metavar="N", help="DSpark: block size [default: 8].")
@click.option("--layers", type=int, metavar="N", help="DSpark: draft decoder layers [default: 2].")
@click.option("--target-layers", metavar="A,B,C",
              help="DSpark: target layers whose outputs feed the draft [default: three spread "
                   "over the depth, never the last].")
@click.option("--steps", type=int, metavar="N", help="Training steps.")
@click.option("--time", "time_", metavar="DURATION",
              help="Wall-clock budget of data preparation and training (90s, 30m, 1h).")
@click.option("--threads", type=int, metavar="N", help="CPU threads (torch and the engine).")
@click.option("--resume", metavar="DIR",
              help="Run directory: checkpoints and data; a killed run continues from it.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of data and training.")
@click.option("--eval-prompts", type=click.Path(), metavar="FILE",
              help="Prompts for the final speculative-decoding measure (JSON list, JSON Lines, "
                   "or one text) [default: from held-out text].")
@click.option("--include", multiple=True, metavar="GLOB", help="In --data folders, only files named so.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="In --data folders, skip files and folders named so (any path component).")
@click.option("--seq-len", type=int, metavar="N", help="Tokens per training window [default: 512].")
@click.option("--windows", type=int, metavar="N",
              help="Training windows of --data text [default: 1024, or what a quarter of --time "
                   "computes].")
@click.option("--batch", type=int, metavar="N", help="Windows per step [default: 16].")
@click.option("--anchors", type=int, default=24, show_default=True, metavar="N",
              help="DSpark: blocks per window per step.")
@click.option("--rollouts", type=int, default=0, show_default=True, metavar="K",
              help="DSpark: at K anchors of every --data window, the target's greedy "
                   "continuation (the tokens verification accepts), computed with the features; "
                   "steps train on them first.")
@click.option("--lr", type=float, metavar="F", help="Peak learning rate [default: 3e-3 DSpark, 2e-3 MTP].")
@click.option("--markov-rank", type=int, default=64, show_default=True, metavar="R",
              help="DSpark: Markov head rank.")
@click.option("--type", "type_", default="Q8_0", show_default=True, metavar="TYPE",
              help="Stored type of the draft's matrices: Q8_0, F16 or F32.")
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Training compute: bfloat16 autocast (float32 weights) or float32.")
@click.option("--eval-anchors", type=int, default=2000, show_default=True, metavar="N",
              help="DSpark: held-out anchors measured at most.")
@click.option("--eval-tokens", type=int, default=128, show_default=True, metavar="N",
              help="Tokens generated per evaluation prompt (0: no prompt measure).")
@click.option("--overwrite", is_flag=True, help="Replace OUT (and its report) if they exist.")
def distill_cmd(target, kind, out, data, self_generate, block_size, layers, target_layers, steps,
                time_, threads, resume, seed, eval_prompts, include, exclude, seq_len, windows,
                batch, anchors, rollouts, lr, markov_rank, type_, precision, eval_anchors,
                eval_tokens, overwrite):
    """Train a DSpark draft or an MTP head for TARGET.gguf (PyTorch: the `train` extra), write it
    as a support GGUF the engine and llama.cpp load, and measure it against prompt lookup."""
    from .distill import DistillOptions, distill, parse_duration
    with _interrupts(), _reported_errors():
        if kind is None:
            raise UsageError("missing option --kind dspark|mtp")
        if out is None:
            raise UsageError("missing option -o OUT.gguf")
        opts = DistillOptions(
            kind, data=list(data), self_generate=self_generate, block_size=block_size,
            layers=layers, target_layers=_int_list(target_layers, "--target-layers"), steps=steps,
            time_s=None if time_ is None else parse_duration(time_), threads=threads,
            resume=resume, seed=seed, eval_prompts=eval_prompts, include=list(include),
            exclude=list(exclude), seq_len=seq_len, windows=windows, markov_rank=markov_rank,
            lr=lr, batch=batch, anchors=anchors, rollouts=rollouts, type=type_.upper(),
            precision=precision,
            eval_anchors=eval_anchors,
            eval_tokens=eval_tokens, overwrite=overwrite)
        result = distill(target, out, opts, report=lambda msg: click.echo(msg, err=True))
    click.echo(result.summary)


if __name__ == "__main__":
    main()
