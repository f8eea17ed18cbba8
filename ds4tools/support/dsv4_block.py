"""One DeepSeek V4 decoder block as ds4 names and checks it (24 tensors), shared by the MTP
head (``mtp.0.``) and the three DSpark stages (``mtp.0.`` .. ``mtp.2.``), plus the mapping from
DeepSeek's Hugging Face names.

Shapes are in ggml order (ne0 first), from the model's dimensions: E hidden, HC hyper-connection
streams (hc_dim = E * HC, mix = 2 * HC + HC * HC), q LoRA rank, H heads of head_dim, output
groups of o_lora, n_expert routed experts of n_ff_exp.
"""
from __future__ import annotations

import math

from .layout import (DENSE_DS4, F32, PLAIN, Q8_0_ONLY, ROUTED_DS4, ROUTED_MTP, Kind,
                     TensorSpec)
from .target import Dims

__all__ = ["block_specs", "infer_block_dims", "HF_BLOCK_NAMES", "HF_EXPERT_PROJ", "mul"]


def mul(*xs):
    """The product, or None when a factor is unknown."""
    out = 1
    for x in xs:
        if x is None:
            return None
        out *= int(x)
    return out


def _div(a, b):
    if a is None or not b or a % b:
        return None
    return a // b


# role -> (kind for the MTP head (ds4 @8d57664), kind for a DSpark stage, default stored type)
_ROLES = {
    "hc_attn_fn": (PLAIN, PLAIN, "F16"),
    "hc_attn_scale": (F32, F32, "F32"),
    "hc_attn_base": (F32, F32, "F32"),
    "attn_norm": (F32, F32, "F32"),
    "attn_q_a": (Q8_0_ONLY, DENSE_DS4, None),
    "attn_q_a_norm": (F32, F32, "F32"),
    "attn_q_b": (Q8_0_ONLY, DENSE_DS4, None),
    "attn_kv": (Q8_0_ONLY, DENSE_DS4, None),
    "attn_kv_a_norm": (F32, F32, "F32"),
    "attn_sinks": (F32, F32, "F32"),
    "attn_output_a": (Q8_0_ONLY, DENSE_DS4, None),
    "attn_output_b": (Q8_0_ONLY, DENSE_DS4, None),
    "hc_ffn_fn": (PLAIN, PLAIN, "F16"),
    "hc_ffn_scale": (F32, F32, "F32"),
    "hc_ffn_base": (F32, F32, "F32"),
    "ffn_norm": (F32, F32, "F32"),
    "ffn_gate_inp": (PLAIN, DENSE_DS4, "F32"),
    "exp_probs_b": (F32, F32, "F32"),
    "ffn_gate_exps": (ROUTED_MTP, ROUTED_DS4, None),
    "ffn_up_exps": (ROUTED_MTP, ROUTED_DS4, None),
    "ffn_down_exps": (ROUTED_MTP, ROUTED_DS4, None),
    "ffn_gate_shexp": (Q8_0_ONLY, DENSE_DS4, None),
    "ffn_up_shexp": (Q8_0_ONLY, DENSE_DS4, None),
    "ffn_down_shexp": (Q8_0_ONLY, DENSE_DS4, None),
}

#: ds4 role -> DeepSeek V4 Hugging Face name (under ``layers.N.`` / ``mtp.N.``); the routed
#: experts are ``ffn.experts.E.w1/w3/w2`` (HF_EXPERT_PROJ), stacked into one 3-D tensor
HF_BLOCK_NAMES = {
    "hc_attn_fn": "hc_attn_fn", "hc_attn_scale": "hc_attn_scale", "hc_attn_base": "hc_attn_base",
    "attn_norm": "attn_norm.weight", "attn_q_a": "attn.wq_a.weight",
    "attn_q_a_norm": "attn.q_norm.weight", "attn_q_b": "attn.wq_b.weight",
    "attn_kv": "attn.wkv.weight", "attn_kv_a_norm": "attn.kv_norm.weight",
    "attn_sinks": "attn.attn_sink", "attn_output_a": "attn.wo_a.weight",
    "attn_output_b": "attn.wo_b.weight", "hc_ffn_fn": "hc_ffn_fn", "hc_ffn_scale": "hc_ffn_scale",
    "hc_ffn_base": "hc_ffn_base", "ffn_norm": "ffn_norm.weight", "ffn_gate_inp": "ffn.gate.weight",
    "exp_probs_b": "ffn.gate.bias", "ffn_gate_shexp": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp": "ffn.shared_experts.w3.weight", "ffn_down_shexp": "ffn.shared_experts.w2.weight",
}
HF_EXPERT_PROJ = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


def _gguf_name(prefix: str, role: str) -> str:
    return f"{prefix}{role}.bias" if role == "exp_probs_b" else f"{prefix}{role}.weight"


def block_specs(prefix: str, d: Dims, dialect: str) -> list[TensorSpec]:
    """The 24 block tensors in the order ds4's validator walks them.

    ``dialect``: "mtp" (ds4's MTP binder: Q8_0 projections, F16/F32 router, IQ2_XXS / Q2_K /
    Q4_K experts) or "dspark" (ds4's DSpark validator: F16/F32/Q8_0 dense tensors)."""
    E, HC = d.n_embd, d.hc
    hc_dim = mul(E, HC)
    mix = None if HC is None else 2 * HC + HC * HC
    q_dim = mul(d.n_head, d.head_dim)
    out_low = mul(d.o_groups, d.o_lora)
    out_a_in = None if d.o_groups is None else _div(mul(d.head_dim, d.n_head), d.o_groups)
    ff, n_exp = d.n_ff_exp, d.n_expert
    shapes = {
        "hc_attn_fn": (hc_dim, mix), "hc_attn_scale": (3,), "hc_attn_base": (mix,),
        "attn_norm": (E,), "attn_q_a": (E, d.q_lora), "attn_q_a_norm": (d.q_lora,),
        "attn_q_b": (d.q_lora, q_dim), "attn_kv": (E, d.head_dim), "attn_kv_a_norm": (d.head_dim,),
        "attn_sinks": (d.n_head,), "attn_output_a": (out_a_in, out_low),
        "attn_output_b": (out_low, E), "hc_ffn_fn": (hc_dim, mix), "hc_ffn_scale": (3,),
        "hc_ffn_base": (mix,), "ffn_norm": (E,), "ffn_gate_inp": (E, n_exp), "exp_probs_b": (n_exp,),
        "ffn_gate_exps": (E, ff, n_exp), "ffn_up_exps": (E, ff, n_exp),
        "ffn_down_exps": (ff, E, n_exp), "ffn_gate_shexp": (E, ff), "ffn_up_shexp": (E, ff),
        "ffn_down_shexp": (ff, E),
    }
    col = 0 if dialect == "mtp" else 1
    out = []
    for role, (mtp_kind, dspark_kind, default) in _ROLES.items():
        kind: Kind = (mtp_kind, dspark_kind)[col]
        out.append(TensorSpec(_gguf_name(prefix, role), role, kind, shapes[role],
                              default_type=default))
    return out


def _ne(f, name: str, i: int):
    t = f.tensors.get(name)
    if t is None or len(t.ggml_shape) <= i:
        return None
    return int(t.ggml_shape[i])


def infer_block_dims(f, prefix: str) -> Dims:
    """The dimensions a block's own tensors imply (for files without our metadata keys)."""
    n = lambda role, i=0: _ne(f, _gguf_name(prefix, role), i)  # noqa: E731
    mix = n("hc_attn_base")
    hc = None
    if mix:
        r = int(round(math.sqrt(1 + mix))) - 1  # HC^2 + 2 HC = mix
        hc = r if r > 0 and r * r + 2 * r == mix else None
    head_dim, n_head = n("attn_kv_a_norm"), n("attn_sinks")
    out_a_in = n("attn_output_a")
    groups = _div(mul(head_dim, n_head), out_a_in) if out_a_in else None
    out_low = n("attn_output_b")
    return Dims(n_embd=n("attn_norm"), hc=hc, q_lora=n("attn_q_a_norm"), head_dim=head_dim,
                n_head=n_head, o_groups=groups, o_lora=_div(out_low, groups) if groups else None,
                n_expert=n("exp_probs_b"), n_ff_exp=n("ffn_gate_shexp", 1))
