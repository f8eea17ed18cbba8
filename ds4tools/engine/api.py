"""``Engine``: load a GGUF model (llama, qwen3, glm4moe, deepseek2, glm-dsa) and generate text with it.

    >>> from ds4tools import Engine
    >>> eng = Engine("model-q8_0.gguf")          # the demo: ds4tools.demo.demo_engine()
    >>> for tok in eng.generate("def fib(n):", max_tokens=32, temperature=0):
    ...     print(tok.text, end="", flush=True)
    >>> eng.last_stats.decode_tps
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import Iterator

import numba
import numpy as np

from ..errors import InvalidContentError, UsageError, about
from ..gguf_io.reader import open_gguf
from .generate import GenerationStats, decode
from .architectures import ARCHITECTURES
from .backends import DEVICES, BackendUnavailable
from .hparams import HParamsError
from .kv_cache import CACHE_TYPES
from .sampling import Sampler
from .tokenizer import GGUFTokenizer, TokenizerError
from .transformer import DEFAULT_CHUNK, ForwardResult, NonFiniteLogits
from .weights import INT8_MODES, WeightsError

#: context size when none is asked for (capped by the model's training context)
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class GeneratedToken:
    id: int
    text: str      # the new complete UTF-8 text this token finished (may be "")


def set_threads(n: int | None) -> int:
    """Use n numba threads (at most the pool size fixed at start-up); returns the count used."""
    if n is not None:
        if n < 1:
            raise UsageError(f"--threads {n}: must be at least 1")
        numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()


#: the seed that asks for a random one, as llama.cpp's --seed -1 (LLAMA_DEFAULT_SEED)
RANDOM_SEED = -1


def resolve_seed(seed: int | None) -> int:
    """The seed a generation uses: ``None`` or -1 draw a fresh one (reported in the stats so
    the run can be repeated); any other negative value is a usage error."""
    if seed is None or int(seed) == RANDOM_SEED:
        return secrets.randbits(32)
    if int(seed) < 0:
        raise UsageError(f"--seed {seed}: must be -1 (a random seed) or a non-negative integer")
    return int(seed)


def _not_a_model(f) -> str | None:
    """Why an opened GGUF is not a model the engine runs (None if it looks like one)."""
    from ..inspect.kinds import detect_kind
    kind = detect_kind(f)
    if kind != "model":
        if kind == "unknown":
            return "holds no model (no tensors or no general.architecture)"
        return f"is not a model but a file of kind '{kind}' (see `ds4tools inspect`)"
    if f.architecture not in ARCHITECTURES:
        return (f"unsupported architecture {f.architecture!r} "
                f"(the engine runs: {', '.join(ARCHITECTURES)})")
    if "token_embd.weight" not in f.tensors:
        return "missing tensor token_embd.weight: not a complete model"
    return None


class Engine:
    """A loaded model, its tokenizer and KV cache.

    ``model_path``: the GGUF to run (required: the bundled demo model is resolved above the
    engine, by ``ds4tools.demo.resolve_model`` / ``demo_engine``). ``spec``: a SpecConfig to
    draft with, its support files given. ``exact=True`` keeps every matmul on the float32-activation path
    (equal to the float64 reference on the dequantized weights to float32 rounding);
    otherwise every quantized matrix takes ggml's int8-activation path (``int8`` "default" or
    "all"; "none" is the same as ``exact=True``).
    ``cache_type``: "f32" or "f16". ``tp``: a ds4tools.tp session: this process runs one
    rank's shard of the model under tensor parallelism. ``device``: "cpu" or "cuda" (weights,
    cache and activations on an NVIDIA GPU; matmuls there take the float32 path)."""

    def __init__(self, model_path=None, *, n_ctx: int | None = None, threads: int | None = None,
                 cache_type: str = "f32", exact: bool = False, int8: str = "default",
                 chunk: int = DEFAULT_CHUNK, spec=None, tp=None, device: str = "cpu"):
        if device not in DEVICES:
            raise UsageError(f"--device {device}: use {' or '.join(DEVICES)}")
        if int8 not in INT8_MODES:
            raise UsageError(f"unknown int8 mode {int8!r} (use {', '.join(INT8_MODES)})")
        if cache_type not in CACHE_TYPES:
            raise UsageError(f"--cache-type {cache_type}: use {' or '.join(CACHE_TYPES)}")
        if n_ctx is not None and n_ctx < 1:
            raise UsageError(f"--ctx {n_ctx}: must be at least 1")
        if model_path is None:
            raise UsageError("no model: pass the path of a GGUF model (the bundled demo model: "
                             "ds4tools.demo.demo_engine())")
        self.threads = set_threads(threads)
        path = os.fspath(model_path)
        if os.path.isdir(path):
            raise UsageError(about(path, "is a directory; convert it first with "
                                         "`ds4tools quantize DIR -o MODEL.gguf --type Q8_0`"))
        if not os.path.exists(path):
            raise UsageError(about(path, "no such file"))
        self.gguf = open_gguf(path)
        self.path = path
        why = _not_a_model(self.gguf)
        if why:
            raise InvalidContentError(about(path, why))
        meta = self.gguf.metadata
        self.architecture = ARCHITECTURES[self.gguf.architecture]
        try:
            embd = self.gguf.tensors["token_embd.weight"]
            self.hparams = self.architecture.read_hparams(meta, n_vocab_tensor=int(embd.shape[0]))
            self.weights = self.architecture.load_weights(self.gguf.tensors, self.hparams,
                                                          int8="none" if exact else int8)
            self.tokenizer = GGUFTokenizer(meta)
        except (HParamsError, WeightsError, TokenizerError) as e:
            raise InvalidContentError(about(path, str(e))) from None
        if self.tokenizer.n_vocab > self.hparams.n_vocab:
            raise InvalidContentError(about(path, f"the tokenizer has {self.tokenizer.n_vocab} tokens "
                                                  f"but the model only {self.hparams.n_vocab} rows"))
        self.exact = exact or device != "cpu"
        self.int8_mode = int8
        self.device = device
        ctx = n_ctx or min(self.hparams.n_ctx_train, DEFAULT_CTX)
        self._model_options = dict(n_ctx=ctx, cache_type=cache_type, chunk=chunk)
        if device != "cpu":
            if device not in self.architecture.devices:
                raise UsageError(about(path, f"--device {device}: {self.hparams.arch} models run on "
                                             f"{' and '.join(self.architecture.devices)} so far"))
            if tp is not None:
                raise UsageError(f"--device {device} and --tp: tensor parallelism runs on the CPU so far")
            self._model_options["device"] = device
        if tp is None:
            try:
                self.model = self.architecture.model(self.hparams, self.weights,
                                                     **self._model_options)
            except BackendUnavailable as e:
                raise UsageError(f"--device {device}: {e}") from None
        else:  # this rank's shard (ds4tools.tp): the same decoder on narrowed weights
            self.model = tp.make_model(self.architecture, self.hparams, self.weights,
                                       **self._model_options)
        self._shares_file = False  # a clone(): the file belongs to the engine it came from
        self.last_stats: GenerationStats | None = None
        self.last_spec_stats = None
        self.spec = None
        self.drafter = None
        if spec is not None and spec.active:
            self.set_spec(spec)

    # --- pieces ---------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    @property
    def cache(self):
        return self.model.cache

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def forward(self, tokens, start_pos: int, **kw) -> ForwardResult:
        """Transformer.forward on this engine's cache (see there)."""
        return self.model.forward(tokens, start_pos, **kw)

    def set_exact(self, exact: bool) -> None:
        """Switch between the float32 (exact) path everywhere and the int8 mode chosen at load."""
        self.exact = bool(exact)
        self.weights.set_int8("none" if exact else self.int8_mode)

    def set_int8(self, mode: str) -> None:
        """Use ggml's int8-activation path "all" where a format has one, by "default", or "none"."""
        self.int8_mode = mode
        self.exact = mode == "none"
        self.weights.set_int8(mode)

    # --- speculative decoding ---------------------------------------------------------------

    def set_spec(self, spec) -> None:
        """Draft with what ``spec`` (a SpecConfig, ds4's flags) asks for; loads and validates the
        support file against this model (--dspark needs its draft as --mtp FILE: the demo's is
        filled in above the engine, by ``ds4tools.demo.resolve_model``)."""
        from .speculative.config import build_drafter
        spec = spec.resolved(temperature=0.0)
        if spec.lookup is None and not self.architecture.model_drafters:
            raise UsageError(about(self.path, f"drafting with a model (--mtp, --glm-mtp, --dspark) "
                                              f"is not available for {self.hparams.arch} models yet; "
                                              f"--lookup N works"))
        self.spec = spec
        self.drafter = build_drafter(self, spec)

    # --- generation ---------------------------------------------------------------------------

    def prompt_tokens(self, prompt: str) -> list[int]:
        """The prompt's tokens, checked: not empty and within the context."""
        if not prompt:
            raise UsageError("the prompt is empty")
        ids = self.tokenize(prompt)
        if not ids:
            raise UsageError("the prompt gives no tokens")
        if len(ids) > self.n_ctx:
            raise UsageError(f"the prompt is {len(ids)} tokens, longer than the context of "
                             f"{self.n_ctx} (--ctx)")
        return ids

    def generate(self, prompt: str, max_tokens: int = 128, *, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 seed: int | None = None, sampler: Sampler | None = None,
                 stop_at_eog: bool = True) -> Iterator[GeneratedToken]:
        """Yield the continuation of ``prompt`` token by token (not the prompt itself).

        Stops after ``max_tokens``, at an end-of-generation token (not yielded), or when the
        context is full. Timings land in ``self.last_stats`` (complete once the iteration
        ends). Deterministic for a given seed (seed=None or -1 draws one; see last_stats.seed)."""
        ids = self.prompt_tokens(prompt)
        if max_tokens < 0:
            raise UsageError(f"-n {max_tokens}: must not be negative")
        try:
            sampler = sampler or Sampler(temperature, top_k, top_p, min_p)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.spec is not None:
            self.spec.resolved(temperature=sampler.temperature)  # e.g. strict mode needs greedy
        seed = resolve_seed(seed)
        stats = GenerationStats(seed=seed)
        self.last_stats = stats
        return self._stream(ids, max_tokens, sampler, np.random.default_rng(int(seed)),
                            stop_at_eog, stats)

    def _stream(self, ids, max_tokens, sampler, rng, stop_at_eog, stats):
        # Each token yields the complete UTF-8 text it finishes; a character split over
        # tokens comes out with its last byte. One left unfinished at the very end is dropped
        # (stats.text_truncated says so).
        stats.warmup_seconds = self._warm_up(sampler)
        text = self.tokenizer.stream()
        eog = self.tokenizer.eog_ids if stop_at_eog else frozenset()
        if self.drafter is None:
            tokens = decode(self.model, ids, max_tokens, sampler, rng, eog, stats)
        else:
            from .speculative import SpecStats, speculative_decode
            self.last_spec_stats = SpecStats(method=self.drafter.name)
            tokens = speculative_decode(self.model, self.drafter, ids, max_tokens, sampler, rng, eog,
                                        stats, self.last_spec_stats, strict=self.spec.dspark_strict,
                                        on_step=self.on_spec_step)
        try:
            for tok in tokens:
                yield GeneratedToken(tok, text.feed(tok))
        except NonFiniteLogits as e:
            raise InvalidContentError(about(self.path, str(e))) from None
        finally:
            tokens.close()  # now, not at garbage collection: the stats are complete when we return
            stats.text_truncated = text.pending > 0

    #: per-step hook of speculative decoding (``--glm-mtp-timing`` sets one that logs)
    on_spec_step = None

    #: the settings already warmed up (see _warm_up)
    _warmed: frozenset = frozenset()

    def _warm_up(self, sampler) -> float:
        """Run a throwaway 2-token generation before the first timed one of each setting;
        returns its seconds (0 once warm).

        The first call of each compiled kernel in a process loads it from numba's cache (or
        compiles it): 0.4-0.7 s that would otherwise be timed as prefill. llama.cpp runs a
        throwaway decode at start-up for the same reason. It goes through the real loop (the
        drafter, the sampler's path) so that every kernel the timed run calls is loaded."""
        key = (self.exact, self.int8_mode, id(self.drafter), sampler.greedy)
        if key in self._warmed:
            return 0.0
        t0 = time.perf_counter()
        prompt = [0] * min(2, self.n_ctx)
        # a plain copy: a caller's sampler may keep state that the throwaway run must not move
        copy = Sampler(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p)
        rng = np.random.default_rng(0)
        try:
            if self.drafter is None:
                tokens = decode(self.model, prompt, 2, copy, rng)
            else:
                from .speculative import speculative_decode
                tokens = speculative_decode(self.model, self.drafter, prompt, 2, copy, rng,
                                            calibrate=False)
            for _ in tokens:
                pass
        except NonFiniteLogits as e:
            raise InvalidContentError(about(self.path, str(e))) from None
        self._warmed = self._warmed | {key}
        return time.perf_counter() - t0

    def clone(self) -> "Engine":
        """Another engine on the same loaded weights and tokenizer (read-only, shared) with its
        own KV cache, workspace and drafter (the support file is loaded again): one per thread,
        since an engine is not thread-safe. Closing a clone leaves the file open; close the
        original last."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        # on a GPU, the clone reads the weights this engine placed there (no second upload)
        weights = self.weights if self.device == "cpu" else self.model.weights
        other.model = self.architecture.model(self.hparams, weights, **self._model_options)
        other._shares_file = True
        other.last_stats = other.last_spec_stats = None
        other._warmed = frozenset()
        other.drafter = None
        if self.spec is not None:
            from .speculative.config import build_drafter
            other.drafter = build_drafter(other, self.spec)
        return other

    def close(self) -> None:
        """Release the model: the weights (views of the memory-mapped file) and the cache.
        The engine cannot run afterwards."""
        if not getattr(self, "_shares_file", False):
            self.gguf.close()
        self.model = self.weights = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        if self.model is None:
            return f"<Engine {self.path!r}: closed>"
        return (f"<Engine {self.path!r}: {hp.arch}, {hp.n_layer} layers, {hp.n_embd} wide, "
                f"ctx {self.n_ctx}, {'exact' if self.exact else 'int8: ' + self.int8_mode}>")
