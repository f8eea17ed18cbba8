"""The DSpark support GGUF in ds4's layout (``deepseek4-dspark`` / ``deepseek41-dspark``).

Three DeepSeek V4 stages ``mtp.0.`` .. ``mtp.2.`` of 24 block tensors each; stage 0 adds
``main_proj`` [n_targets * E -> E] and ``main_norm``; the final stage adds ``norm``, the
hyper-connection head (``hc_head_base/fn/scale``, V4 only), ``markov_head.markov_w1/w2``
[r, V] and ``confidence_head.proj`` [E + r -> 1] (no bias): 81 tensors for V4, 78 for V4.1.

Metadata: ``dspark.block_size``, ``dspark.markov_rank``, ``dspark.noise_token_id`` (UINT32)
and ``dspark.target_layer_ids`` (UINT32 / INT32 array), each also read under ds4's two other
spellings (``deepseek4.dspark.<key>``, ``deepseek4.dspark_<key>``); ``dspark.stage_count``,
``dspark.n_layers``, ``dspark.n_expert`` / ``dspark.n_expert_used``. Our writer also records
the target's dimensions under ``dspark.`` (``DESCRIPTION_KEYS``).

Validation is ds4's (dspark_weights_validate_layout), every problem collected, in its words.
"""
from __future__ import annotations

from gguf import GGUFValueType as V

from ..gguf_io import MetaKey
from . import meta
from .dsv4_block import block_specs, infer_block_dims
from .layout import DENSE_DS4, DS4_DSPARK, F32, PLAIN, Problems, TensorSpec, check_tensor
from .target import DIM_LABELS, Dims, TargetInfo

__all__ = ["ARCH_V4", "ARCH_V41", "ARCHS", "MAX_BLOCK_SIZE", "KEY_ALIASES", "Summary",
           "read_summary", "summary_lines", "specs", "validate", "metadata_keys", "N_STAGES"]

ARCH_V4, ARCH_V41 = "deepseek4-dspark", "deepseek41-dspark"
ARCHS = (ARCH_V4, ARCH_V41)
MAX_BLOCK_SIZE = 16  # DS4_DSPARK_MAX_BLOCK_SIZE
N_STAGES = 3


def _aliases(key: str) -> tuple[str, str, str]:
    return (f"deepseek4.dspark.{key}", f"deepseek4.dspark_{key}", f"dspark.{key}")


KEY_ALIASES = {k: _aliases(k) for k in ("block_size", "markov_rank", "noise_token_id",
                                        "target_layer_ids")}
#: our description of the target, under "dspark.": (Dims field, GGUF type)
DESCRIPTION_KEYS = {
    "embedding_length": ("n_embd", V.UINT32), "vocab_size": ("n_vocab", V.UINT32),
    "target_block_count": ("n_layer", V.UINT32), "attention.head_count": ("n_head", V.UINT32),
    "attention.key_length": ("head_dim", V.UINT32), "attention.q_lora_rank": ("q_lora", V.UINT32),
    "attention.output_lora_rank": ("o_lora", V.UINT32),
    "attention.output_group_count": ("o_groups", V.UINT32),
    "expert_feed_forward_length": ("n_ff_exp", V.UINT32),
    "expert_shared_count": ("n_shared", V.UINT32), "hyper_connection.count": ("hc", V.UINT32),
    "attention.layer_norm_rms_epsilon": ("rms_eps", V.FLOAT32),
    "rope.freq_base": ("rope_base", V.FLOAT32),
    "n_expert": ("n_expert", V.UINT32), "n_expert_used": ("n_expert_used", V.UINT32),
}
PAIR_DIMS = ("n_embd", "n_vocab", "n_layer", "n_head", "head_dim", "q_lora", "o_lora",
             "o_groups", "n_ff_exp", "hc")


class Summary:
    """ds4's model_dspark_summary: the metadata values and what the tensor names show."""

    def __init__(self, f):
        self.block_size = meta.u32_any(f, KEY_ALIASES["block_size"])
        self.markov_rank = meta.u32_any(f, KEY_ALIASES["markov_rank"])
        self.noise_token_id = meta.u32_any(f, KEY_ALIASES["noise_token_id"])
        self.target_layers = meta.u32_array_any(f, KEY_ALIASES["target_layer_ids"])
        stages = [_stage(n) for n in f.tensors]
        stages = [s for s in stages if s is not None]
        self.stages = max(stages) + 1 if stages else 0
        self.stages_present = sorted(set(stages))
        #: the stages to check: 0..stages-1, unless stage numbers skip (a lying name such as
        #: mtp.1000000.x must not make the validator walk a million stages)
        self.stages_checked = min(self.stages, len(self.stages_present))
        names = list(f.tensors)
        self.has_main_proj = any(".main_proj." in n for n in names if _stage(n) is not None)
        self.has_main_norm = any(".main_norm." in n for n in names if _stage(n) is not None)
        self.has_markov_head = any(".markov_head." in n for n in names if _stage(n) is not None)
        self.has_confidence_head = any(".confidence_head." in n for n in names if _stage(n) is not None)
        self.has_final_head = any((".hc_head_" in n or ".norm.weight" in n)
                                  for n in names if _stage(n) is not None)

    @property
    def is_dspark(self) -> bool:
        """support_model_detect's rule."""
        return (self.stages >= 3 and self.has_main_proj and self.has_markov_head
                and self.has_confidence_head)


def _stage(name: str) -> int | None:
    """N of an ``mtp.<N>.`` name (ds4_tensor_mtp_stage)."""
    if not name.startswith("mtp."):
        return None
    digits = ""
    for ch in name[4:]:
        if not ch.isdigit():
            break
        digits += ch
    if not digits or len(name) <= 4 + len(digits) or name[4 + len(digits)] != ".":
        return None
    return int(digits)


read_summary = Summary


def summary_lines(s: Summary) -> list[str]:
    """ds4's model_print_dspark_summary (values of 0 are left out, as ds4 does)."""
    line = f"mtp/dspark: stages={s.stages}"
    if s.block_size:
        line += f" block={s.block_size}"
    if s.markov_rank:
        line += f" markov_rank={s.markov_rank}"
    if s.noise_token_id:
        line += f" noise_token={s.noise_token_id}"
    if s.target_layers:
        line += " target_layers=" + ",".join(map(str, s.target_layers))
    lines = [line]
    if (s.has_main_proj or s.has_main_norm or s.has_markov_head or s.has_confidence_head
            or s.has_final_head):
        yn = lambda b: "yes" if b else "no"  # noqa: E731
        lines.append(f"mtp/dspark tensors: main_proj={yn(s.has_main_proj)} "
                     f"main_norm={yn(s.has_main_norm)} markov={yn(s.has_markov_head)} "
                     f"confidence={yn(s.has_confidence_head)} final_head={yn(s.has_final_head)}")
    return lines


def metadata_keys(arch: str, block_size: int, markov_rank: int, noise_token_id: int,
                  target_layers, dims: Dims, name: str) -> list[MetaKey]:
    values = dims.known()
    keys = [
        MetaKey("general.name", name, V.STRING),
        MetaKey("general.alignment", 32, V.UINT32),
        MetaKey("dspark.block_size", int(block_size), V.UINT32),
        MetaKey("dspark.markov_rank", int(markov_rank), V.UINT32),
        MetaKey("dspark.noise_token_id", int(noise_token_id), V.UINT32),
        MetaKey("dspark.target_layer_ids", [int(x) for x in target_layers], V.ARRAY, V.UINT32),
        MetaKey("dspark.stage_count", N_STAGES, V.UINT32),
        MetaKey("dspark.n_layers", N_STAGES, V.UINT32),
    ]
    for suffix, (field, vtype) in DESCRIPTION_KEYS.items():
        if values.get(field) is not None:
            v = values[field]
            keys.append(MetaKey(f"dspark.{suffix}", float(v) if vtype == V.FLOAT32 else int(v), vtype))
    return keys


def read_description(f) -> Dims:
    values = {}
    for suffix, (field, vtype) in DESCRIPTION_KEYS.items():
        key = f"dspark.{suffix}"
        v = meta.u32(f, key) if vtype == V.UINT32 else meta.number(f, key)
        if v is not None:
            values[field] = v
    return Dims(**values)


def specs(d: Dims, n_stages: int, n_targets: int, markov_rank: int, with_hc_head: bool
          ) -> list[TensorSpec]:
    """Every tensor, in the order ds4's validator walks them."""
    E, HC = d.n_embd, d.hc
    out = []
    for stage in range(n_stages):
        p = f"mtp.{stage}."
        out += block_specs(p, d, "dspark")
        if stage == 0:
            out += [TensorSpec(p + "main_proj.weight", "main_proj", DENSE_DS4,
                               (None if E is None else n_targets * E, E)),
                    TensorSpec(p + "main_norm.weight", "main_norm", F32, (E,), default_type="F32")]
    if n_stages == 0:
        return out
    p = f"mtp.{n_stages - 1}."
    out.append(TensorSpec(p + "norm.weight", "norm", F32, (E,), default_type="F32"))
    out += [
        TensorSpec(p + "hc_head_base.weight", "hc_head_base", F32, (HC,), required=with_hc_head,
                   default_type="F32"),
        TensorSpec(p + "hc_head_fn.weight", "hc_head_fn", PLAIN,
                   (None if E is None or HC is None else E * HC, HC), required=with_hc_head,
                   default_type="F16"),
        TensorSpec(p + "hc_head_scale.weight", "hc_head_scale", F32, (1,), required=with_hc_head,
                   default_type="F32"),
        TensorSpec(p + "markov_head.markov_w1.weight", "markov_w1", DENSE_DS4, (markov_rank, d.n_vocab)),
        TensorSpec(p + "markov_head.markov_w2.weight", "markov_w2", DENSE_DS4, (markov_rank, d.n_vocab)),
        TensorSpec(p + "confidence_head.proj.weight", "confidence_proj", DENSE_DS4,
                   (None if E is None else E + markov_rank, 1), default_type="F32"),
    ]
    return out


def _metadata_errors(s: Summary, n_vocab: int | None, n_layer: int | None) -> list[str]:
    """dspark_weights_validate_metadata, message for message."""
    err = []
    if not s.block_size:
        err.append("missing or zero block size")
    elif s.block_size > MAX_BLOCK_SIZE:
        err.append("block size exceeds runtime limit")
    if not s.markov_rank:
        err.append("missing or zero Markov rank")
    if s.noise_token_id is None or (n_vocab is not None and s.noise_token_id >= n_vocab):
        err.append("missing or out-of-range noise token")
    if not s.target_layers:
        err.append("missing target layer list")
        return err
    prev = None
    for i, layer in enumerate(s.target_layers):
        if n_layer is not None and layer >= n_layer:
            err.append("target layer is outside the target model")
        if i and layer <= prev:
            err.append("target layers are not strictly increasing")
        prev = layer
    return err


def expected_dims(f, s: Summary, target: TargetInfo | None) -> Dims:
    own = read_description(f)
    inferred = infer_block_dims(f, "mtp.0.")
    w1 = f.tensors.get(f"mtp.{max(s.stages - 1, 0)}.markov_head.markov_w1.weight")
    if w1 is not None and len(w1.ggml_shape) == 2:
        inferred = inferred.merged(Dims(n_vocab=int(w1.ggml_shape[1])))
    d = own.merged(inferred)
    if target is not None:
        # the file's own expert counts win (V4.1 drafts route over their own, smaller pool);
        # everything else is the target's
        mine = Dims(n_expert=own.n_expert, n_expert_used=own.n_expert_used)
        d = mine.merged(target.dims).merged(d)
    return d


def validate(f, target: TargetInfo | None = None) -> Problems:
    out = Problems()
    s = Summary(f)
    d = expected_dims(f, s, target)
    if target is not None:
        _pair(out, f, target)
    for msg in _metadata_errors(s, d.n_vocab, d.n_layer):
        out.error(f"DSpark metadata error: {msg}")
    if s.stages_checked < s.stages:
        shown = ", ".join(map(str, s.stages_present[:8])) + ("..." if len(s.stages_present) > 8 else "")
        out.error(f"the mtp.* stages are not numbered 0..{s.stages - 1}: the file has stage(s) {shown}")
    v41 = f.architecture == ARCH_V41
    all_specs = specs(d, s.stages_checked, len(s.target_layers or []), s.markov_rank or 0, not v41)
    for spec in all_specs:
        for msg in check_tensor(spec, f.tensors.get(spec.name), DS4_DSPARK):
            out.error(msg)
        if spec.role == "ffn_up_exps":
            g = f.tensors.get(spec.name.replace("ffn_up_exps", "ffn_gate_exps"))
            u = f.tensors.get(spec.name)
            if g is not None and u is not None and g.ggml_type != u.ggml_type:
                out.error("DSpark routed gate/up experts use different quant types")
    known = {sp.name for sp in all_specs}
    for name in f.tensors:
        if name not in known:
            out.warning(f"tensor {name} is not part of the DSpark layout (ds4 ignores it)")
    if f.architecture not in ARCHS:
        out.warning(f"general.architecture is '{f.architecture}'; ds4's DSpark support files "
                    f"say '{ARCH_V4}' or '{ARCH_V41}'")
    return out


def _pair(out: Problems, f, target: TargetInfo) -> None:
    family = {"deepseek4": ARCH_V4, "deepseek41": ARCH_V41}.get(target.arch)
    if family is None:
        out.error(f"DSpark metadata error: the target {target.path} is a {target.arch} model, "
                  f"not DeepSeek V4")
    elif f.architecture in ARCHS and f.architecture != family:
        out.error(f"DSpark metadata error: a {f.architecture} support file does not belong to "
                  f"a {target.arch} target")
    own = read_description(f)
    for name in PAIR_DIMS:
        mine, theirs = getattr(own, name), getattr(target.dims, name)
        if mine is not None and theirs is not None and mine != theirs:
            out.error(f"the DSpark draft was made for a target with {DIM_LABELS[name]} {mine}, "
                      f"but {target.path} has {theirs}")
