"""The DSpark draft GGUF in llama.cpp's layout: architecture ``dflash`` with a Markov head
(``markov_w1.weight`` present), a Qwen3 backbone, loaded by ``llama_model_dflash``
(src/models/dflash.cpp) and run with ``--spec-type draft-dspark``. The name ``dspark`` (one
llama.cpp version's separate class) is accepted on read.

Tensors: ``fc`` [n_targets * H_target -> H], ``enc.output_norm`` (DeepSpec's ``hidden_norm``),
``output_norm`` (``norm``), ``blk.i.{attn_norm, attn_q, attn_k, attn_v, attn_output,
attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``markov_w1`` and
``markov_w2`` [r, V], ``conf_proj`` [H + r -> 1] and ``conf_proj.bias`` [1]. Embedding and
output head are the target's (llama.cpp shares them through the target context).

Keys: ``dflash.target_layers`` (required), ``dflash.block_size`` (required with a Markov head),
``dflash.target_hidden_size``, ``dflash.mask_token_id`` and ``tokenizer.ggml.mask_token_id``
(llama.cpp's drafter reads the latter), ``dflash.sample_from_anchor`` (true: DeepSpec's
anchor-first block), ``dflash.has_confidence_head``, the standard Qwen3 backbone keys and the
target's tokenizer.

Layer numbering: llama.cpp captures the *input* of each listed target layer
(``llama_set_embeddings_layer_inp``), while DeepSpec's ``target_layer_ids`` name the layer whose
*output* is used. So ``dflash.target_layers`` = DeepSpec id + 1 (see docs/support-gguf.md).
llama.cpp's llama and qwen3 graphs expose the inputs of layers 0..n-1 only: an id equal to the
layer count (DeepSpec's last layer, the target's output) has no tensor there and llama.cpp
aborts (``GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null")``). The
writer refuses such a draft and ``validate`` with a target reports it (``uncapturable``);
ds4tools' engine, which reads the raw output of any layer, still runs it.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from gguf import GGUFValueType as V

from ..gguf_io import MetaKey
from . import meta
from .layout import LLAMA_CPP, Kind, Problems, TensorSpec, check_tensor
from .target import Dims, TargetInfo

__all__ = ["ARCH", "ARCHS", "specs", "validate", "metadata_keys", "read_hparams", "DraftHparams",
           "summary_lines", "to_llama_layers", "from_llama_layers", "blocks_present",
           "INPUT_CAPTURE_ARCHS", "uncapturable", "uncapturable_message"]

ARCH = "dflash"
ARCHS = ("dflash", "dspark")
#: llama.cpp loads any ggml type; the type is not part of its checks
_ANY = Kind("any ggml type", frozenset(GGMLQuantizationType.__members__))


def to_llama_layers(deepspec_ids) -> list[int]:
    """DeepSpec target_layer_ids (layer outputs; -1 = the embedding) -> dflash.target_layers."""
    return [int(i) + 1 for i in deepspec_ids]


def from_llama_layers(stored) -> list[int]:
    return [int(i) - 1 for i in stored]


#: target architectures whose llama.cpp graphs expose only the inputs of layers 0..n-1 to the
#: draft (llama.cpp's src/models/llama.cpp, qwen3.cpp): the last layer's output is not there
INPUT_CAPTURE_ARCHS = ("llama", "qwen3")


def uncapturable(target_arch: str | None, n_layer: int | None, deepspec_ids) -> list[int]:
    """The DeepSpec layer ids (outputs) llama.cpp cannot capture on this target: the last
    layer's output (dflash id n_layer) for llama / qwen3 targets."""
    if target_arch not in INPUT_CAPTURE_ARCHS or n_layer is None:
        return []
    return [int(i) for i in deepspec_ids if int(i) + 1 >= int(n_layer)]


def uncapturable_message(layer: int, target_arch: str, n_layer: int, where: str) -> str:
    """Why llama.cpp cannot run a draft reading DeepSpec layer ``layer`` of this target."""
    return (f"target layer {layer} (dflash.target_layers {layer + 1}) is the output of the last "
            f"of {where}'s {n_layer} layers: llama.cpp's {target_arch} graph captures only the "
            f"inputs of layers 0..{n_layer - 1} and aborts on it (GGML_ASSERT layer input "
            f"tensor is null); a draft for llama.cpp reads layers up to {n_layer - 2}")


class DraftHparams:
    """What a dflash/dspark GGUF says about itself (None: not stored)."""

    def __init__(self, f):
        a = (f.architecture or ARCH) + "."
        self.arch = f.architecture
        g = lambda k: meta.integer(f, a + k)  # noqa: E731
        self.n_embd = g("embedding_length")
        self.n_layer = g("block_count")
        self.context_length = g("context_length")
        self.n_head = _first_int(f.metadata.get(a + "attention.head_count"))
        self.n_head_kv = _first_int(f.metadata.get(a + "attention.head_count_kv")) or self.n_head
        self.head_dim = g("attention.key_length") or (
            self.n_embd // self.n_head if self.n_embd and self.n_head else None)
        self.n_ff = _first_int(f.metadata.get(a + "feed_forward_length"))
        self.rms_eps = meta.number(f, a + "attention.layer_norm_rms_epsilon")
        self.rope_base = meta.number(f, a + "rope.freq_base")
        self.block_size = g("block_size")
        self.target_layers = meta.int_array(f, a + "target_layers")
        self.target_hidden_size = g("target_hidden_size")
        self.mask_token_id = g("mask_token_id")
        self.vocab_mask_token_id = meta.integer(f, "tokenizer.ggml.mask_token_id")
        anchor = f.metadata.get(a + "sample_from_anchor")
        self.sample_from_anchor = True if anchor is None else (anchor is True or anchor == "true")
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        self.n_vocab = len(tokens) if isinstance(tokens, list) else g("vocab_size")
        w1 = f.tensors.get("markov_w1.weight")
        self.markov_rank = int(w1.ggml_shape[0]) if w1 is not None else None
        if self.n_vocab is None and w1 is not None and len(w1.ggml_shape) > 1:
            self.n_vocab = int(w1.ggml_shape[1])

    @property
    def mask_token(self) -> int | None:
        return self.vocab_mask_token_id if self.vocab_mask_token_id is not None else self.mask_token_id


read_hparams = DraftHparams


def _first_int(v):
    if isinstance(v, list):
        v = v[0] if v else None
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def specs(h: DraftHparams, n_embd_target: int | None, n_vocab: int | None) -> list[TensorSpec]:
    """llama_model_dflash::load_arch_tensors for a Qwen3 backbone with a DSpark head."""
    E, hd = h.n_embd, h.head_dim
    q = None if h.n_head is None or hd is None else h.n_head * hd
    kv = None if h.n_head_kv is None or hd is None else h.n_head_kv * hd
    n_targets = len(h.target_layers) if h.target_layers is not None else None
    enc_in = None if n_targets is None or n_embd_target is None else n_targets * n_embd_target
    r = h.markov_rank
    out = [
        TensorSpec("token_embd.weight", "token_embd", _ANY, (E, n_vocab), required=False),
        TensorSpec("markov_w1.weight", "markov_w1", _ANY, (r, n_vocab)),
        TensorSpec("markov_w2.weight", "markov_w2", _ANY, (r, n_vocab)),
        TensorSpec("conf_proj.weight", "conf_proj", _ANY,
                   (None if E is None or r is None else E + r, 1), required=False, default_type="F32"),
        TensorSpec("conf_proj.bias", "conf_proj_bias", _ANY, (1,), required=False, default_type="F32"),
        TensorSpec("fc.weight", "fc", _ANY, (enc_in, E)),
        TensorSpec("enc.output_norm.weight", "hidden_norm", _ANY, (E,), default_type="F32"),
        TensorSpec("output_norm.weight", "norm", _ANY, (E,), default_type="F32"),
        TensorSpec("output.weight", "output", _ANY, (E, n_vocab), required=False),
    ]
    for i in range(h.n_layer or 0):
        p = f"blk.{i}."
        out += [
            TensorSpec(p + "attn_norm.weight", "attn_norm", _ANY, (E,), default_type="F32"),
            TensorSpec(p + "attn_q.weight", "attn_q", _ANY, (E, q)),
            TensorSpec(p + "attn_k.weight", "attn_k", _ANY, (E, kv)),
            TensorSpec(p + "attn_v.weight", "attn_v", _ANY, (E, kv)),
            TensorSpec(p + "attn_output.weight", "attn_output", _ANY, (q, E)),
            TensorSpec(p + "attn_q_norm.weight", "attn_q_norm", _ANY, (hd,), default_type="F32"),
            TensorSpec(p + "attn_k_norm.weight", "attn_k_norm", _ANY, (hd,), default_type="F32"),
            TensorSpec(p + "attn_sinks.weight", "attn_sinks", _ANY, (h.n_head,), required=False),
            TensorSpec(p + "ffn_norm.weight", "ffn_norm", _ANY, (E,), default_type="F32"),
            TensorSpec(p + "ffn_gate.weight", "ffn_gate", _ANY, (E, h.n_ff)),
            TensorSpec(p + "ffn_down.weight", "ffn_down", _ANY, (h.n_ff, E)),
            TensorSpec(p + "ffn_up.weight", "ffn_up", _ANY, (E, h.n_ff)),
        ]
    return out


def metadata_keys(*, dims: Dims, n_layer: int, block_size: int, target_layers, mask_token_id: int,
                  target_hidden_size: int, name: str, has_confidence: bool) -> list[MetaKey]:
    """The dflash keys of a draft with a Qwen3 backbone (tokenizer keys come separately)."""
    a = ARCH + "."
    keys = [
        MetaKey("general.name", name, V.STRING),
        MetaKey(a + "block_count", int(n_layer), V.UINT32),
        MetaKey(a + "context_length", int(dims.context_length or 2048), V.UINT32),
        MetaKey(a + "embedding_length", int(dims.n_embd), V.UINT32),
        MetaKey(a + "feed_forward_length", int(dims.n_ff), V.UINT32),
        MetaKey(a + "attention.head_count", int(dims.n_head), V.UINT32),
        MetaKey(a + "attention.head_count_kv", int(dims.n_head_kv), V.UINT32),
        MetaKey(a + "attention.key_length", int(dims.head_dim), V.UINT32),
        MetaKey(a + "attention.value_length", int(dims.head_dim), V.UINT32),
        MetaKey(a + "rope.dimension_count", int(dims.head_dim), V.UINT32),
        MetaKey(a + "rope.freq_base", float(dims.rope_base or 10000.0), V.FLOAT32),
        MetaKey(a + "attention.layer_norm_rms_epsilon", float(dims.rms_eps or 1e-6), V.FLOAT32),
        MetaKey(a + "vocab_size", int(dims.n_vocab), V.UINT32),
        MetaKey(a + "block_size", int(block_size), V.UINT32),
        MetaKey(a + "target_layers", [int(x) for x in target_layers], V.ARRAY, V.INT32),
        MetaKey(a + "target_hidden_size", int(target_hidden_size), V.UINT32),
        MetaKey(a + "mask_token_id", int(mask_token_id), V.UINT32),
        MetaKey(a + "sample_from_anchor", True, V.BOOL),
        MetaKey(a + "has_confidence_head", bool(has_confidence), V.BOOL),
    ]
    return keys


def summary_lines(h: DraftHparams) -> list[str]:
    """ds4's summary line, for a llama.cpp-layout draft (target layers as layer outputs)."""
    line = f"mtp/dspark: stages={h.n_layer or 0}"
    if h.block_size:
        line += f" block={h.block_size}"
    if h.markov_rank:
        line += f" markov_rank={h.markov_rank}"
    if h.mask_token:
        line += f" noise_token={h.mask_token}"
    if h.target_layers:
        line += " target_layers=" + ",".join(map(str, from_llama_layers(h.target_layers)))
    lines = [line]
    if h.target_layers:
        lines.append(f"{h.arch}.target_layers=" + ",".join(map(str, h.target_layers))
                     + " (llama.cpp reads the input of each listed layer: output id + 1)")
    return lines


_REQUIRED_KEYS = ("context_length", "embedding_length", "block_count",
                  "attention.layer_norm_rms_epsilon")


def validate(f, target: TargetInfo | None = None) -> Problems:
    out = Problems()
    arch = f.architecture or ARCH
    h = DraftHparams(f)
    for suffix in _REQUIRED_KEYS:
        if f"{arch}.{suffix}" not in f.metadata:
            out.error(f"key not found in model: {arch}.{suffix}")
    if h.target_layers is None:
        out.error("DFlash model requires 'target_layers' in GGUF metadata")
    has_markov = "markov_w1.weight" in f.tensors
    if has_markov and h.block_size is None:
        out.error(f"DSpark draft requires '{arch}.block_size' in GGUF metadata")
    elif h.block_size is not None and h.block_size <= 0:
        out.error(f"'{arch}.block_size' is {h.block_size}; llama.cpp asserts block_size > 0")
    if h.vocab_mask_token_id is None:
        out.error("tokenizer.ggml.mask_token_id is missing: llama.cpp's drafter takes its mask "
                  "token from the vocabulary and would draft with token -1")
    elif h.mask_token_id is not None and h.mask_token_id != h.vocab_mask_token_id:
        out.error(f"{arch}.mask_token_id is {h.mask_token_id} but tokenizer.ggml.mask_token_id "
                  f"is {h.vocab_mask_token_id}")
    if h.n_vocab is not None and h.mask_token is not None and h.mask_token >= h.n_vocab:
        out.error(f"the mask token {h.mask_token} is outside the {h.n_vocab} tokens")
    if h.target_layers is not None:
        if any(x < 0 for x in h.target_layers):
            out.error(f"{arch}.target_layers has a negative layer id: {h.target_layers}")
        if any(b <= a for a, b in zip(h.target_layers, h.target_layers[1:])):
            out.warning(f"{arch}.target_layers {h.target_layers} is not strictly increasing "
                        f"(DeepSpec trains drafts on increasing layers)")
    if h.target_hidden_size is not None and h.n_embd is not None and h.target_hidden_size != h.n_embd:
        out.warning(f"{arch}.target_hidden_size {h.target_hidden_size} differs from the draft's "
                    f"hidden size {h.n_embd}: llama.cpp sizes fc from the draft's")
    n_embd_target = h.n_embd  # llama.cpp: n_embd_inp_enc = len(target_layers) * n_embd (draft)
    n_vocab = h.n_vocab
    if target is not None:
        _pair(out, h, target, arch)
    blocks = blocks_present(f)
    if h.n_layer is not None and h.n_layer > blocks:
        out.error(f"{arch}.block_count is {h.n_layer}, but the file has tensors for {blocks} "
                  f"block(s)")
        h.n_layer = blocks  # check the blocks that are there, not a lying count
    all_specs = specs(h, n_embd_target, n_vocab)
    for spec in all_specs:
        for msg in check_tensor(spec, f.tensors.get(spec.name), LLAMA_CPP):
            out.error(msg)
    if not has_markov:
        out.error("no markov_w1.weight: a DFlash draft without the DSpark Markov head")
    known = {s.name for s in all_specs}
    extra = [n for n in f.tensors if n not in known]
    if extra:
        out.error(f"done_getting_tensors: wrong number of tensors; expected {len(f.tensors) - len(extra)}, "
                  f"got {len(f.tensors)} (llama.cpp does not load {', '.join(extra[:3])}"
                  f"{'...' if len(extra) > 3 else ''})")
    return out


def blocks_present(f) -> int:
    ids = [int(n.split(".")[1]) for n in f.tensors
           if n.startswith("blk.") and n.split(".")[1].isdigit()]
    return max(ids) + 1 if ids else 0


def _pair(out: Problems, h: DraftHparams, target: TargetInfo, arch: str) -> None:
    td = target.dims
    if td.n_vocab is not None and h.n_vocab is not None and td.n_vocab != h.n_vocab:
        out.error(f"the draft's vocabulary has {h.n_vocab} tokens, but {target.path} has {td.n_vocab}")
    if td.n_embd is not None and h.n_embd is not None and td.n_embd != h.n_embd:
        out.error(f"the draft's hidden size is {h.n_embd}, but {target.path} has {td.n_embd}")
    if h.target_layers is not None and td.n_layer is not None:
        for stored in h.target_layers:
            if stored > td.n_layer:
                out.error(f"{arch}.target_layers {stored} reads the output of target layer "
                          f"{stored - 1}, but {target.path} has {td.n_layer} layers")
        inside = [x for x in from_llama_layers(h.target_layers) if x + 1 <= td.n_layer]
        for layer in uncapturable(target.arch, td.n_layer, inside):
            out.error(uncapturable_message(layer, target.arch, td.n_layer, target.path),
                      only="llama.cpp")
    if h.mask_token is not None and td.n_vocab is not None and h.mask_token >= td.n_vocab:
        out.error(f"the mask token {h.mask_token} is outside the target's {td.n_vocab} tokens")
