"""``ds4tools serve``: load the model into N slots, bind the socket, run the app under uvicorn."""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

from ..errors import InvalidContentError, UsageError, about


@dataclass
class ServeOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    ctx: int | None = None
    parallel: int = 1
    queue: int = 16
    threads: int | None = None
    cache_type: str = "f32"
    exact: bool = False
    alias: str | None = None
    chat_template_file: str | None = None
    spec: object = None            # a SpecConfig, or None
    retry_after: int = 1
    log_level: str = "warning"


def check_options(o: ServeOptions) -> None:
    if o.parallel < 1:
        raise UsageError(f"--parallel {o.parallel}: must be at least 1")
    if o.queue < 0:
        raise UsageError(f"--queue {o.queue}: must not be negative")
    if not 0 <= o.port <= 65535:
        raise UsageError(f"--port {o.port}: must be in 0..65535 (0: any free port)")
    if o.api_key is not None and not o.api_key.strip():
        raise UsageError("--api-key: must not be empty")
    if o.retry_after < 0:
        raise UsageError(f"--retry-after {o.retry_after}: must not be negative")


def read_template_file(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise UsageError(about(path, e.strerror or str(e))) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(about(path, f"not UTF-8 text (byte {e.start})")) from None


def load_state(o: ServeOptions, *, resolve_model=None, say=None):
    """Engines for every slot (the first loads the model; the others are clones sharing its
    weights), warmed up; returns the ServerState the app serves."""
    from ..engine.api import Engine
    from .app import ServerState
    from .metrics import Metrics
    from .slots import SlotPool
    from .template import ChatTemplateError, model_template

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_options(o)
    spec = o.spec
    if spec is not None:
        spec = spec.resolved(temperature=0.0)
        if spec.timing:
            raise UsageError("--glm-mtp-timing logs per step on stderr; not available in serve "
                             "(the /metrics endpoint and each response's ds4tools field report "
                             "acceptance)")
    override = read_template_file(o.chat_template_file) if o.chat_template_file else None
    model = o.model
    if resolve_model is not None:
        model, spec = resolve_model(model, spec)
    first = Engine(model, n_ctx=o.ctx, threads=o.threads, cache_type=o.cache_type, exact=o.exact,
                   spec=spec)
    if first.drafter is not None:
        say(f"ds4tools: {first.drafter.describe()}")
    try:
        template = model_template(first, override)
    except ChatTemplateError as e:
        raise (UsageError(about(o.chat_template_file, str(e))) if override is not None
               else InvalidContentError(about(first.path, str(e)))) from None
    engines = [first] + [first.clone() for _ in range(o.parallel - 1)]
    for eng in engines:  # load the compiled kernels now, not in the first request
        _warm(eng)
    metrics = Metrics()
    pool = SlotPool(engines, metrics, queue_size=o.queue, threads=o.threads)
    name = o.alias or (os.path.splitext(os.path.basename(first.path))[0] if o.model is not None
                       else "ds4tools-demo")
    return ServerState(pool=pool, metrics=metrics, model_id=name, n_ctx=first.n_ctx,
                       tokenizer=first.tokenizer, template=template, api_key=o.api_key,
                       retry_after=o.retry_after, created=int(time.time()),
                       speculative=first.drafter.name if first.drafter is not None else None,
                       greedy_only=first.spec is not None and first.spec.dspark_strict)


def _warm(engine) -> None:
    strict = engine.spec is not None and engine.spec.dspark_strict  # refuses sampling
    for temp in (0.0,) if strict else (0.0, 1.0):  # the greedy and the sampled paths
        for _ in engine.generate("a", 2, temperature=temp, seed=0, stop_at_eog=False):
            pass


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (its errors as usage errors, before the server starts)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(o: ServeOptions, *, resolve_model=None) -> int:
    """Run the server until Ctrl-C / SIGTERM; returns the exit code."""
    import uvicorn

    from .app import build_app

    check_options(o)
    sock = bind(o.host, o.port)  # before loading: a taken port fails fast
    state = load_state(o, resolve_model=resolve_model)
    app = build_app(state)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"ds4tools: serving {state.model_id} on http://{shown}:{port}/v1 "
          f"({state.pool.slots} slot{'s' if state.pool.slots > 1 else ''}, context {state.n_ctx}"
          f"{', drafting: ' + state.speculative if state.speculative else ''})", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=o.log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        state.pool.close()
        sock.close()
    return 0
