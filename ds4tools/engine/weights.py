"""Model weights as memory-mapped GGUF tensors, checked against the hyper-parameters.

A ``Linear`` is a raw view of a weight matrix's GGUF blocks (no copy: the pages come from the
file), its format from the registry and its logical shape (n_out, n_in); ``matmul`` decodes the
blocks on the fly inside the format's fused kernel. Small tensors (norms, biases) are decoded
to float32 once at load time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import formats
from ..formats.activations import quantize_activations
from .hparams import HParams


INT8_MODES = ("default", "all", "none")


def int8_for(fmt, mode: str, n_in: int | None = None, n_out: int | None = None) -> bool:
    """Whether a matrix of format ``fmt`` with rows of ``n_in`` (``n_out`` of them) takes the
    int8-activation path: "default" where the format has one and the matrix is large enough for
    it to pay (``fmt.int8_min_row``, ``fmt.int8_min_weights``: short rows and small matrices
    run faster in float32), "all" wherever the format has one,
    "none" nowhere (float32 everywhere: ``--exact``). The choice is per matrix and fixed at
    load time, so a token's result never depends on its batch."""
    if mode not in INT8_MODES:
        raise ValueError(f"unknown int8 mode {mode!r} (use {', '.join(INT8_MODES)})")
    if not fmt.has_int8_matmul or mode == "none":
        return False
    if mode == "all" or n_in is None:
        return True
    return n_in >= fmt.int8_min_row and (n_out is None or n_out * n_in >= fmt.int8_min_weights)


class SharedInput:
    """One matmul input read by several matrices (q, k, v; gate, up): its int8 blocks are
    made once per activation type and reused by every matrix that reads it."""

    __slots__ = ("x", "_quantized")

    def __init__(self, x: np.ndarray):
        self.x = x
        self._quantized: dict = {}

    def quantized(self, kind: str):
        act = self._quantized.get(kind)
        if act is None:
            act = self._quantized[kind] = quantize_activations(self.x, kind)
        return act


class WeightsError(ValueError):
    """A tensor problem (missing, wrong shape, unreadable type); the caller adds the file."""


class Linear:
    """y = x @ W.T with W (n_out, n_in) kept as raw GGUF blocks."""

    __slots__ = ("name", "raw", "fmt", "n_out", "n_in", "int8", "whole_n_out")

    def __init__(self, name: str, raw: np.ndarray, fmt, shape, *, int8: bool = False):
        self.name = name
        self.fmt = formats.get_format(fmt)
        self.n_out, self.n_in = (int(s) for s in shape)
        expect = formats.byte_shape((self.n_out, self.n_in), self.fmt)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != expect[0] * expect[1]:
            raise WeightsError(f"tensor {name}: {raw.size} bytes of data, expected "
                               f"{expect[0] * expect[1]} for {self.fmt.name} {tuple(shape)}")
        self.raw = raw.reshape(expect)
        if not self.raw.flags.c_contiguous:
            raise WeightsError(f"tensor {name}: data is not contiguous")
        #: whether matmul takes ggml's int8-activation path (faster, not exact to f32)
        self.int8 = bool(int8 and self.fmt.has_int8_matmul)
        #: the rows of the whole matrix this one is a slice of (a tensor-parallel shard), which
        #: int8_for judges, so every rank takes the path of the unsplit matrix
        self.whole_n_out = self.n_out

    @classmethod
    def from_float(cls, name: str, w: np.ndarray, fmt, **kw) -> "Linear":
        """Quantize a float matrix (tests, synthetic models)."""
        w = np.asarray(w, np.float32)
        return cls(name, formats.quantize(w, fmt), fmt, w.shape, **kw)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def matmul(self, x, out: np.ndarray, int8: bool | None = None) -> np.ndarray:
        """out (k, n_out) = x (k, n_in) @ W.T; x float32 C-contiguous or a SharedInput, out
        float32 C-contiguous (unchecked: the decoder owns its buffers). ``int8`` overrides the
        path chosen at load time."""
        shared = x if isinstance(x, SharedInput) else None
        rows = shared.x if shared is not None else x
        use_int8 = self.int8 if int8 is None else (int8 and self.fmt.has_int8_matmul)
        if not use_int8:
            self.fmt._cpu_matmul(self.raw, rows, out)
        elif shared is not None:
            self.fmt._cpu_matmul_q8(self.raw, shared.quantized(self.fmt.act_type), out)
        else:
            self.fmt._cpu_matmul_int8(self.raw, rows, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of W decoded to float32 (k, n_in): the token-embedding lookup."""
        picked = np.ascontiguousarray(self.raw[np.asarray(ids, np.int64)])
        return self.fmt._cpu_dequantize(picked, self.n_in)

    def dequantize(self) -> np.ndarray:
        return self.fmt._cpu_dequantize(self.raw, self.n_in)

    def __repr__(self) -> str:
        return f"<Linear {self.name} {self.fmt.name} {self.n_out}x{self.n_in}{' int8' if self.int8 else ''}>"


@dataclass
class LayerWeights:
    """One llama/qwen3 decoder layer (llama.cpp's blk.N.* tensors)."""
    attn_norm: np.ndarray
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    ffn_norm: np.ndarray
    w_gate: Linear
    w_up: Linear
    w_down: Linear
    q_norm: np.ndarray | None = None   # qwen3: RMSNorm over each head's query
    k_norm: np.ndarray | None = None
    bq: np.ndarray | None = None       # optional projection biases (llama allows them)
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None

    def linears(self) -> list[Linear]:
        return [self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down]


@dataclass
class ModelWeights:
    token_embd: Linear
    layers: list[LayerWeights]
    output_norm: np.ndarray
    output: Linear                      # token_embd itself when the output is tied
    rope_freqs: np.ndarray | None = None
    tied_output: bool = False
    formats_used: dict = field(default_factory=dict)

    def linears(self) -> list[Linear]:
        """Every matrix a forward multiplies with (the layers' and the output)."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.output]

    def set_int8(self, mode: str) -> None:
        """Choose the matmul path of every matrix (see int8_for): "none" is the exact float32
        path everywhere."""
        for lin in self.linears():
            lin.int8 = int8_for(lin.fmt, mode, lin.n_in, getattr(lin, "whole_n_out", lin.n_out))


# --- loading from GGUF tensors ---------------------------------------------------------------


def _tensor(tensors: dict, name: str, shape: tuple[int, ...], *, required: bool = True):
    t = tensors.get(name)
    if t is None:
        if required:
            raise WeightsError(f"missing tensor {name}")
        return None
    got = tuple(int(s) for s in t.shape)
    if got != tuple(shape):
        raise WeightsError(f"tensor {name} has shape {got} (numpy order), expected {tuple(shape)}")
    if formats.format_for_type(t.ggml_type) is None:
        raise WeightsError(f"tensor {name} has type {t.type_name}, which the engine cannot read "
                           f"(known: {', '.join(formats.FORMATS)})")
    return t


_PLAIN_FLOATS = {"F32": np.float32, "F16": np.float16}


def _vector(tensors: dict, name: str, n: int, *, required: bool = True):
    t = _tensor(tensors, name, (n,), required=required)
    if t is None:
        return None
    plain = _PLAIN_FLOATS.get(t.type_name)
    if plain is not None:  # norms are F32 (llama.cpp keeps 1-D tensors so): no kernel needed
        return np.asarray(t.raw()).view(plain).astype(np.float32).reshape(n)
    return np.ascontiguousarray(np.asarray(t.to_float32(), np.float32).reshape(n))


def _linear(tensors: dict, name: str, n_out: int, n_in: int, int8: str) -> Linear:
    t = _tensor(tensors, name, (n_out, n_in))
    fmt = formats.format_for_type(t.ggml_type)
    if n_in % fmt.block_size:
        raise WeightsError(f"tensor {name}: row length {n_in} is not a multiple of "
                           f"{fmt.name}'s block size {fmt.block_size}")
    # np.asarray: a plain ndarray view of the memory map (numba dispatches faster on it)
    return Linear(name, np.asarray(t.raw()), fmt, (n_out, n_in),
                  int8=int8_for(fmt, int8, n_in, n_out))


def load_layer(tensors: dict, prefix: str, hp: HParams, int8: str) -> LayerWeights:
    """One llama/qwen3 decoder layer from tensors named ``<prefix><part>.weight`` (the
    model's ``blk.N.``, or an MTP head's / a DSpark draft's layers). q/k norms are required for
    qwen3 and read when present otherwise."""
    p = prefix
    H, Q, KV = hp.n_embd, hp.n_q, hp.n_kv
    qk_norm = hp.arch == "qwen3" or (p + "attn_q_norm.weight") in tensors
    return LayerWeights(
        attn_norm=_vector(tensors, p + "attn_norm.weight", H),
        wq=_linear(tensors, p + "attn_q.weight", Q, H, int8),
        wk=_linear(tensors, p + "attn_k.weight", KV, H, int8),
        wv=_linear(tensors, p + "attn_v.weight", KV, H, int8),
        wo=_linear(tensors, p + "attn_output.weight", H, Q, int8),
        ffn_norm=_vector(tensors, p + "ffn_norm.weight", H),
        w_gate=_linear(tensors, p + "ffn_gate.weight", hp.n_ff, H, int8),
        w_up=_linear(tensors, p + "ffn_up.weight", hp.n_ff, H, int8),
        w_down=_linear(tensors, p + "ffn_down.weight", H, hp.n_ff, int8),
        q_norm=_vector(tensors, p + "attn_q_norm.weight", hp.head_dim, required=qk_norm),
        k_norm=_vector(tensors, p + "attn_k_norm.weight", hp.head_dim, required=qk_norm),
        bq=_vector(tensors, p + "attn_q.bias", Q, required=False),
        bk=_vector(tensors, p + "attn_k.bias", KV, required=False),
        bv=_vector(tensors, p + "attn_v.bias", KV, required=False),
        bo=_vector(tensors, p + "attn_output.bias", H, required=False),
    )


def load_weights(tensors: dict, hp: HParams, *, int8: str = "default") -> ModelWeights:
    """ModelWeights from GGUF tensors (name -> TensorRef: .shape, .ggml_type, .type_name, .raw(),
    .to_float32()), llama.cpp's names. Raises WeightsError on a missing or misshapen tensor.
    ``int8``: the matmul path mode (see int8_for)."""
    int8_for(formats.get_format("F32"), int8)  # validates the mode
    H = hp.n_embd
    layers = [load_layer(tensors, f"blk.{i}.", hp, int8) for i in range(hp.n_layer)]
    token_embd = _linear(tensors, "token_embd.weight", hp.n_vocab, H, "none")
    tied = "output.weight" not in tensors
    if tied:  # the same bytes, as a separate Linear so its matmul path can differ
        output = Linear(token_embd.name, token_embd.raw, token_embd.fmt, token_embd.shape,
                        int8=int8_for(token_embd.fmt, int8, H, hp.n_vocab))
    else:
        output = _linear(tensors, "output.weight", hp.n_vocab, H, int8)
    rope_freqs = _vector(tensors, "rope_freqs.weight", hp.n_rot // 2, required=False)
    expected = _expected_names(hp)
    unknown = [n for n in tensors if n not in expected]
    if unknown:
        raise WeightsError(f"unexpected tensor {unknown[0]} for a {hp.arch} model"
                           + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    used: dict[str, int] = {}
    weights = ModelWeights(token_embd, layers, _vector(tensors, "output_norm.weight", H), output,
                           rope_freqs, tied, used)
    for lin in [token_embd] + weights.linears()[:-1] + ([] if tied else [output]):
        used[lin.fmt.name] = used.get(lin.fmt.name, 0) + 1
    return weights


_LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                  "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                  "ffn_down.weight", "attn_q_norm.weight", "attn_k_norm.weight", "attn_q.bias",
                  "attn_k.bias", "attn_v.bias", "attn_output.bias",
                  "attn_rot_embd")  # old llama files carry rotary tables llama.cpp ignores


def _expected_names(hp: HParams) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    for i in range(hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.{t}" for t in _LAYER_TENSORS)
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):  # loaded by the MTP drafter, if asked
        names.update(f"blk.{i}.nextn.{t}.weight" for t in
                     ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head"))
    return names
