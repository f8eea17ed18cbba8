"""llama.cpp's quantization mixes ("file types") and its per-tensor type rules.

The behaviour follows llama.cpp's src/llama-quant.cpp (tensor_allows_quantization,
llama_tensor_get_type, tensor_type_fallback, tensor_requires_imatrix): which tensors are
quantized at all, which type each gets under a mix such as Q4_K_M, the shape fallbacks, and the
order in which its layer counters advance. ``TypeChooser`` holds that state for one model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from .errors import InvalidContentError, UsageError

__all__ = ["FTYPES", "ALIASES", "Target", "resolve_target", "TypeChooser", "allows_quantization",
           "tensor_category", "is_quantized", "block_size", "llama_cpp_order", "PRESETS",
           "ds4_q2_type"]

# A mix's name -> its default tensor type (llama_ftype_get_default_type)
_DEFAULT_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0",
    "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
    "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S",
    "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
    "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0",
}
#: mix name -> general.file_type value (gguf's LlamaFileType)
FTYPES = {name: int(LlamaFileType["ALL_F32" if name == "F32" else "MOSTLY_" + name])
          for name in _DEFAULT_TYPE}
#: llama-quantize's short names
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
GUESSED_FTYPE = int(LlamaFileType.GUESSED)

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}

# --- presets next to llama.cpp's mixes: other tools' recipes, by the name they go under ----------

#: ds4's 2-bit DeepSeek V4 recipe ("q2", its files' names spell it out:
#: IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8): routed gate / up experts IQ2_XXS, routed down experts
#: Q2_K, the attention projections, shared experts and output Q8_0, the token embedding and the
#: hyper-connection / compressor / indexer / router matrices F16; vectors F32 and the hash
#: table I32 as they are. IQ2_XXS takes the --imatrix file, else ds4's synthetic one.
DS4_Q2 = "DS4_Q2"
#: preset -> (general.file_type, the names it is also called by)
PRESETS = {DS4_Q2: (int(LlamaFileType.MOSTLY_IQ2_XXS), ("IQ2XXS-W2Q2K-APROJQ8-SEXPQ8-OUTQ8",))}
_PRESET_ALIASES = {alias: name for name, (_, aliases) in PRESETS.items() for alias in aliases}
_DS4_ATTN_PROJ = re.compile(r"^blk\.\d+\.attn_(q_a|q_b|kv|output_a|output_b)\.weight$")


def ds4_q2_type(name: str, n_dims: int) -> str | None:
    """The type ds4's 2-bit recipe gives a tensor (None: kept as it is: vectors, the I32 table)."""
    if n_dims < 2 or not name.endswith("weight") or "ffn_gate_tid2eid" in name:
        return None
    if "ffn_gate_exps" in name or "ffn_up_exps" in name:
        return "IQ2_XXS"
    if "ffn_down_exps" in name:
        return "Q2_K"
    if name == "token_embd.weight":
        return "F16"
    if name == "output.weight" or "_shexp." in name or _DS4_ATTN_PROJ.search(name):
        return "Q8_0"
    if any(s in name for s in ("hc_", "compressor", "indexer", "ffn_gate_inp")):
        return "F16"
    return "Q8_0"

# Where llama.cpp moves a type whose block does not divide a row (tensor_type_fallback)
_FALLBACK = {
    **{t: "IQ4_NL" for t in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")},
    **{t: "Q4_0" for t in ("Q2_K", "Q3_K", "TQ1_0", "TQ2_0")},
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}

# Weights llama.cpp never quantizes, by name fragment (tensor_allows_quantization)
_NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
) + tuple(f"time_mix_{s}.weight" for s in (
    "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1",
    "decay_w2", "lerp_fused"))
_NEVER_QUANTIZED_EXACT = ("position_embd.weight", "token_types.weight")
# llama.cpp's further exclusions (hc_*, indexer.{attn_q_b, attn_k, proj}, attn_kv_a_mqa,
# attn_k_b, attn_v_b...) apply to its glm5-next architecture only: deepseek2, glm4moe and
# glm-dsa quantize those weights like any other (indexer.attn_k under the attn_k rules), and
# their 3-D experts follow the ffn_gate / ffn_up / ffn_down rules with the layer read from the
# name, as below.


def is_quantized(type_name: str) -> bool:
    return type_name not in _FLOAT_TYPES


def block_size(type_name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def allows_quantization(name: str, n_dims: int, quantize_output: bool = True) -> bool:
    """Whether llama.cpp would quantize this tensor at all (2-D and 3-D weights, not norms...)."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if name == "output.weight" and not quantize_output:
        return False
    if name in _NEVER_QUANTIZED_EXACT:
        return False
    return not any(frag in name for frag in _NEVER_QUANTIZED)


# --- categories --------------------------------------------------------------------------------

TOKEN_EMBD, OUTPUT, ATTN_Q, ATTN_K, ATTN_V, ATTN_QKV, ATTN_KV_B, ATTN_OUTPUT = (
    "token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_kv_b", "attn_output")
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = "ffn_up", "ffn_gate", "ffn_down", "other"
_BY_FRAGMENT = (("attn_qkv.weight", ATTN_QKV), ("attn_kv_b.weight", ATTN_KV_B),
                ("attn_v.weight", ATTN_V), ("attn_k.weight", ATTN_K), ("attn_q.weight", ATTN_Q),
                ("attn_output.weight", ATTN_OUTPUT), ("ffn_up", FFN_UP), ("ffn_gate", FFN_GATE),
                ("ffn_down", FFN_DOWN))
_ATTN_V_LIKE = (ATTN_V, ATTN_QKV, ATTN_KV_B)


def tensor_category(name: str) -> str:
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    for frag, cat in _BY_FRAGMENT:
        if frag in name:
            return cat
    return OTHER


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def llama_cpp_order(names):
    """Names in the order llama.cpp's loader walks them: non-block tensors first, then block by
    block, by name within each (the mix counters advance in this order)."""
    def key(n):
        m = _BLOCK.match(n)
        return (int(m.group(1)) if m else -1, n.encode())
    return sorted(names, key=key)


# --- targets -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str  # the mix ("Q4_K_M") or the plain type ("Q8_0")
    default_type: str
    ftype: int  # general.file_type
    is_mix: bool  # llama.cpp's per-tensor rules apply


def resolve_target(name: str, available) -> Target:
    """A --type value: one of llama.cpp's mixes (Q4_K_M, Q8_0...; Q4_K means Q4_K_M as in
    llama-quantize), else a plain format of the registry."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    key = _PRESET_ALIASES.get(key, key)
    if key in PRESETS:
        return Target(key, "Q8_0", PRESETS[key][0], True)
    if key in _DEFAULT_TYPE:
        default = _DEFAULT_TYPE[key]
        if default not in available:
            raise UsageError(f"--type {name}: its base type {default} is not implemented here "
                             f"(available: {', '.join(available)})")
        return Target(key, default, FTYPES[key], True)
    if key in available:
        return Target(key, key, GUESSED_FTYPE, False)
    known = sorted(set(_DEFAULT_TYPE) | set(ALIASES) | set(PRESETS) | set(available))
    raise UsageError(f"--type {name}: unknown type or mix (known: {', '.join(known)})")


# --- the rules ---------------------------------------------------------------------------------

_IQ_LOW = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class Choice:
    type_name: str
    reason: str  # "mix", "pure", "override", "--output-tensor-type"... for the plan
    fallback_from: str | None = None
    note: str | None = None


@dataclass
class TypeChooser:
    """llama.cpp's per-tensor type decision for one model and one target. Call ``choose`` for
    every tensor in ``llama_cpp_order``: the layer counters advance as in llama.cpp."""
    target: Target
    arch: str
    n_layer: int
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0
    has_imatrix: bool = False
    pure: bool = False
    output_type: str | None = None
    token_embedding_type: str | None = None
    overrides: list[tuple[re.Pattern, str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # every tensor of the model

    def __post_init__(self):
        self.n_attention_wv = sum(tensor_category(n) in _ATTN_V_LIKE for n in self.names)
        self.has_tied_embeddings = "output.weight" not in self.names
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head and self.n_head_kv else 1

    @property
    def is_70b(self) -> bool:
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv

    def choose(self, name: str, ggml_shape) -> Choice | None:
        """The output type of a weight, or None when llama.cpp leaves the tensor as it is."""
        if self.target.name == DS4_Q2 and not self.pure:
            return self._ds4_q2(name, ggml_shape)
        if not allows_quantization(name, len(ggml_shape)):
            return None
        cat = tensor_category(name)
        if self.token_embedding_type and cat == TOKEN_EMBD:
            return self._fit(Choice(self.token_embedding_type, "--token-embedding-type"), ggml_shape, name)
        if self.output_type and cat == OUTPUT:
            return self._fit(Choice(self.output_type, "--output-tensor-type"), ggml_shape, name)
        choice = Choice(self.target.default_type, "pure" if self.pure or not self.target.is_mix else "mix")
        if not is_quantized(choice.type_name):
            return choice
        for pattern, type_name in self.overrides:
            if pattern.search(name):
                return self._fit(Choice(type_name, f"--tensor-type {pattern.pattern}"), ggml_shape, name)
        if self.target.is_mix and not self.pure:
            choice.type_name = self._mix_rule(name, cat, ggml_shape, choice.type_name)
        return self._fit(choice, ggml_shape, name)

    def _ds4_q2(self, name: str, ggml_shape) -> Choice | None:
        """ds4's 2-bit recipe (DS4_Q2); --token-embedding-type, --output-tensor-type and
        --tensor-type still take precedence."""
        t = ds4_q2_type(name, len(ggml_shape))
        if t is None:
            return None
        cat = tensor_category(name)
        if self.token_embedding_type and cat == TOKEN_EMBD:
            return self._fit(Choice(self.token_embedding_type, "--token-embedding-type"), ggml_shape, name)
        if self.output_type and cat == OUTPUT:
            return self._fit(Choice(self.output_type, "--output-tensor-type"), ggml_shape, name)
        for pattern, type_name in self.overrides:
            if pattern.search(name):
                return self._fit(Choice(type_name, f"--tensor-type {pattern.pattern}"), ggml_shape, name)
        choice = Choice(t, "ds4 q2")
        return self._fit(choice, ggml_shape, name) if is_quantized(t) else choice

    def _fit(self, choice: Choice, ggml_shape, name: str) -> Choice:
        """tensor_type_fallback: a type whose block does not divide the row length gives way."""
        ne0 = int(ggml_shape[0])
        t = choice.type_name
        if ne0 % block_size(t) == 0:
            return choice
        self.n_fallback += 1
        to = _FALLBACK.get(t)
        if to is None:
            choice.note = (f"row length {ne0} is not a multiple of {t}'s block {block_size(t)}; "
                           f"llama.cpp has no fallback for {t} and stops, F16 is used here")
            to = "F16"
        elif ne0 % block_size(to) != 0:
            choice.note = f"row length {ne0} fits neither {t} nor {to}: F16"
            to = "F16"
        else:
            choice.note = f"row length {ne0} is not a multiple of {t}'s block {block_size(t)}"
        choice.fallback_from, choice.type_name = t, to
        return choice

    def _layer(self, counter: int, n: int, name: str) -> tuple[int, int]:
        if self.n_expert > 1:  # experts are not consecutive: read the layer from the name
            m = _BLOCK.match(name)
            if not m or not 0 <= int(m.group(1)) < n:
                raise InvalidContentError(f"tensor '{name}': cannot tell its layer (of {n})")
            return int(m.group(1)), n
        return counter, n

    def _mix_rule(self, name: str, cat: str, ggml_shape, t: str) -> str:  # noqa: C901 - one table
        f = self.target.name
        falcon = self.arch == "falcon"
        if cat == OUTPUT or (self.has_tied_embeddings and cat == TOKEN_EMBD):
            if self.output_type:
                return self.output_type
            if falcon or int(ggml_shape[0]) % block_size(t):
                return "Q8_0"
            if f in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
                return "Q5_K"
            return t if t == "Q8_0" else "Q6_K"
        if cat == TOKEN_EMBD:
            if f in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
                return "Q2_K"
            if f in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
                return "IQ3_S"
            if f in ("TQ1_0", "TQ2_0"):
                return "Q4_K"
            return t
        if f in _IQ_LOW:
            if cat in _ATTN_V_LIKE:
                self.i_attention_wv += 1
                if self.n_gqa >= 4 or self.n_expert >= 4:
                    return "Q4_K"
                return "IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K"
            if self.n_expert == 8 and cat == ATTN_K:
                return "Q4_K"
            if cat == FFN_DOWN:
                low = self.i_ffn_down < self.n_layer // 8
                self.i_ffn_down += 1
                if low:
                    return "IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K"
                return t
            if cat == ATTN_OUTPUT:
                if self.n_expert == 8:
                    return "Q5_K"
                if f in ("IQ1_S", "IQ1_M"):
                    return "IQ2_XXS"
                if f in ("IQ2_S", "IQ2_M"):
                    return "IQ3_S"
            return t
        if cat in _ATTN_V_LIKE:
            t = self._attn_v(f, t)
            if self.is_70b and t in ("Q3_K", "Q4_K"):
                t = "Q5_K"
            if self.n_expert == 8:
                t = "Q8_0"
            self.i_attention_wv += 1
            return t
        if cat == ATTN_K:
            if self.n_expert == 8:
                return "Q8_0"
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
        if cat == ATTN_Q:
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
        if cat == FFN_DOWN:
            i, n = self._layer(self.i_ffn_down, self.n_layer, name)
            self.i_ffn_down += 1
            return self._ffn_down(f, t, i, n, falcon)
        if cat == ATTN_OUTPUT:
            if falcon:
                return "Q4_K" if f == "Q3_K_L" else t
            if self.n_expert == 8:
                bumped = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S",
                          "Q4_K_M", "IQ3_S", "IQ3_M", "IQ4_XS")
                return "Q5_K" if f in bumped else t
            return {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K",
                    "IQ3_M": "Q4_K"}.get(f, t)
        if cat == ATTN_QKV:
            return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "IQ3_M": "Q4_K", "Q4_K_M": "Q5_K",
                    "Q5_K_M": "Q6_K"}.get(f, t)
        if cat in (FFN_GATE, FFN_UP):
            counter = "i_ffn_gate" if cat == FFN_GATE else "i_ffn_up"
            i, n = self._layer(getattr(self, counter), self.n_layer, name)
            setattr(self, counter, getattr(self, counter) + 1)
            if f == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
                return "IQ3_XXS"
        return t

    def _attn_v(self, f: str, t: str) -> str:
        gqa4, i = self.n_gqa >= 4, self.i_attention_wv
        if f == "Q2_K":
            return "Q4_K" if gqa4 else "Q3_K"
        if f == "Q2_K_S" and gqa4:
            return "Q4_K"
        if f == "IQ3_XXS":
            return "Q4_K" if gqa4 else ("IQ3_XXS" if self.has_imatrix else "IQ3_S")
        if f in ("IQ3_XS", "IQ3_S") and gqa4:
            return "Q4_K"
        if f == "IQ3_M":
            return "Q4_K"
        if f == "Q3_K_M":
            return "Q5_K" if i < 2 else "Q4_K"
        if f == "Q3_K_L":
            return "Q5_K"
        if f in ("IQ4_NL", "IQ4_XS") and gqa4:
            return "Q5_K"
        if f in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, self.n_attention_wv):
            return "Q6_K"
        if f == "Q4_K_S" and i < 4:
            return "Q5_K"
        return t

    def _ffn_down(self, f: str, t: str, i: int, n: int, falcon: bool) -> str:
        more = _use_more_bits(i, n)
        if f == "Q2_K":
            return "Q3_K"
        if f == "Q2_K_S":
            return "Q4_K" if i < n // 8 else t
        if f == "IQ3_XXS" and not self.has_imatrix:
            return "Q4_K" if i < n // 8 else "Q3_K"
        if f == "Q3_K_M":
            if i < n // 16:
                return "Q5_K"
            return "Q4_K" if not falcon or more else "Q3_K"
        if f == "IQ3_M" and (i < n // 8 or (self.n_expert == 8 and more)):
            return "Q4_K"
        if f == "Q3_K_L":
            return "Q4_K" if falcon else "Q5_K"
        if f == "Q4_K_M":
            if falcon:
                return "Q6_K" if i < n // 16 else ("Q5_K" if more else "Q4_K")
            return "Q6_K" if more else t
        if i < n // 8 and f in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix:
            return "Q5_K"
        if f == "Q5_K_M" and more:
            return "Q6_K"
        if f == "Q4_K_S" and not falcon and i < n // 8:
            return "Q5_K"
        if f in ("Q4_0", "Q5_0") and self.has_imatrix and i < n // 8:
            return "Q4_1" if f == "Q4_0" else "Q5_1"
        return t

    def requires_imatrix(self, name: str, type_name: str) -> bool:
        """tensor_requires_imatrix: the very low-bit types need one (not for the embeddings)."""
        if tensor_category(name) in (TOKEN_EMBD, OUTPUT):
            return False
        if self.target.name in PRESETS:
            return False  # ds4 quantizes with its synthetic imatrix when there is no file
        if type_name in ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"):
            return True
        return type_name == "Q2_K" and self.target.name == "Q2_K_S"
