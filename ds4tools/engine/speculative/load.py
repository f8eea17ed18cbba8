"""Building drafters from files: a support GGUF (MTP head or DSpark draft), or the NextN layer
embedded in the model GGUF (``--glm-mtp``). Every file goes through ``ds4tools.support``: the
same detection, validation and messages as ``ds4tools inspect``, checked against the target.
"""
from __future__ import annotations

import dataclasses

from ...errors import InvalidContentError, UsageError, about
from ...support.detect import MTP as MTP_KIND
from ...support.support_file import open_support
from ..hparams import HParams
from ..weights import WeightsError, _linear, _vector, load_layer
from .dspark import DSparkWeights
from .mtp import MtpHeadWeights

def _mtp_from_support(sf, hp: HParams, int8: str, model=None) -> MtpHeadWeights:
    t = sf.gguf.tensors
    p = "mtp.0."
    own = model.load_ds4_mtp_head(sf, int8) if model is not None else None
    if own is not None:  # DeepSeek V4: ds4's own MTP file (mtp.0 with hyper-connections, experts)
        return own
    if model is not None and not model.dense_mtp_heads:
        raise UsageError(about(sf.path, f"is an MTP head in ds4's layout (mtp.0.*: a dense "
                                        f"llama/qwen3 layer); a {hp.arch} model drafts with its "
                                        f"own NextN layer: --glm-mtp, or --mtp with llama.cpp's "
                                        f"MTP-only file (ds4tools quantize --mtp-out)"))
    if (p + "attn_q_a.weight") in t or (p + "hc_head_fn.weight") in t:
        raise UsageError(about(sf.path, f"is a DeepSeek V4 MTP head (mtp.0 with hyper-connections "
                                        f"and experts): it drafts for deepseek4 models; a {hp.arch} "
                                        f"model's ds4-layout MTP head is a dense qwen3/llama layer"))
    H = hp.n_embd
    return MtpHeadWeights(
        enorm=_vector(t, p + "enorm.weight", H), hnorm=_vector(t, p + "hnorm.weight", H),
        norm=_vector(t, p + "norm.weight", H), layer=load_layer(t, p, hp, int8),
        e_proj=_linear(t, p + "e_proj.weight", H, H, int8),
        h_proj=_linear(t, p + "h_proj.weight", H, H, int8),
        source=f"MTP head {sf.path} (ds4 layout, NextN layer {sf.hparams.nextn_layer_index})")


def mtp_from_nextn(gguf, hp: HParams, int8: str, model=None, *,
                   flag: str = "--glm-mtp") -> MtpHeadWeights:
    """The first NextN layer in a GGUF of the target's architecture (``blk.L.nextn.*`` +
    ``blk.L.*``): the model's own file (``--glm-mtp``), or llama.cpp's MTP-only file split from
    the same checkpoint (``--mtp FILE``). ``model``: the target model, whose architecture loads
    the layer (None: a llama / qwen3 layer)."""
    from ...support import nextn
    e = nextn.find(gguf)
    if e is None:
        raise UsageError(about(gguf.path, f"{flag}: the model has no NextN layers "
                                          f"({gguf.architecture}.nextn_predict_layers is absent)"))
    if nextn.is_trunk_only(gguf):
        raise UsageError(about(gguf.path, f"{flag}: the NextN layer is not in this file (llama.cpp's "
                                          f"trunk-only layout: {gguf.architecture}.nextn_predict_layers "
                                          f"is {e.n_nextn} but no blk.{e.blocks[0]}.* tensor); draft "
                                          f"with the MTP-only file split from the same checkpoint: "
                                          f"--mtp FILE"))
    problems = nextn.validate(gguf)
    if problems.errors:
        raise InvalidContentError(about(gguf.path, problems.errors[0]),
                                  findings=[about(gguf.path, m) for m in problems.errors])
    L = e.blocks[0]
    t = gguf.tensors
    H = hp.n_embd
    own = nextn.gguf_nextn_name(L, "embed_tokens"), nextn.gguf_nextn_name(L, "shared_head_head")
    try:
        if model is not None:
            layer = model.load_nextn_layer(t, L, int8)
        else:
            layer = load_layer(t, f"blk.{L}.", hp, int8)
        return MtpHeadWeights(
            enorm=_vector(t, nextn.gguf_nextn_name(L, "enorm"), H),
            hnorm=_vector(t, nextn.gguf_nextn_name(L, "hnorm"), H),
            norm=_vector(t, nextn.gguf_nextn_name(L, "shared_head_norm"), H),
            layer=layer,
            eh_proj=_linear(t, nextn.gguf_nextn_name(L, "eh_proj"), H, 2 * H, int8),
            embed=_linear(t, own[0], hp.n_vocab, H, "none") if own[0] in t else None,
            output=_linear(t, own[1], hp.n_vocab, H, int8) if own[1] in t else None,
            source=f"NextN layer blk.{L} "
                   f"{'embedded in' if flag == '--glm-mtp' else 'of'} {gguf.path}")
    except WeightsError as err:
        raise InvalidContentError(about(gguf.path, str(err))) from None


def _open_nextn_file(path):
    """The opened GGUF if ``path`` is a model-architecture file that declares NextN layers
    (llama.cpp's MTP-only file, or a whole model with them), else None (a support file, or
    something open_support reports)."""
    from ...gguf_io.reader import open_gguf
    from ...support import nextn
    try:
        f = open_gguf(path)
    except Exception:  # noqa: BLE001 - open_support reads it again and says what is wrong
        return None
    from ..architectures import ARCHITECTURES
    if f.architecture not in ARCHITECTURES or nextn.find(f) is None:
        f.close()
        return None
    return f


def _mtp_from_llamacpp(f, target_path, target_hp: HParams, int8: str, model) -> MtpHeadWeights:
    """llama.cpp's MTP-only file (``quantize --mtp-out`` for DeepSeek / GLM): the NextN blocks
    under the target's architecture, checked against the target's hyper-parameters."""
    from ..architectures import ARCHITECTURES
    from ..hparams import HParamsError
    arch = f.architecture
    if arch != target_hp.arch:
        raise UsageError(about(f.path, f"is a {arch} file with NextN layers; the model "
                                       f"{target_path} is {target_hp.arch}"))
    embd = f.tensors.get("token_embd.weight")
    try:
        hp = ARCHITECTURES[arch].read_hparams(
            f.metadata, n_vocab_tensor=None if embd is None else int(embd.shape[0]))
    except HParamsError as e:
        raise InvalidContentError(about(f.path, str(e))) from None
    for fld in dataclasses.fields(hp):
        if fld.compare and getattr(hp, fld.name) != getattr(target_hp, fld.name):
            raise InvalidContentError(about(
                f.path, f"does not fit the model {target_path}: {fld.name} is "
                        f"{getattr(hp, fld.name)} here, {getattr(target_hp, fld.name)} there"))
    return mtp_from_nextn(f, target_hp, int8, model, flag="--mtp")


def _draft_hparams(target_hp: HParams, sf) -> HParams:
    d = sf.hparams.draft
    hd = d.head_dim or target_hp.head_dim
    return dataclasses.replace(
        target_hp, arch="qwen3" if sf.has("attn_q_norm", 0) else target_hp.arch,
        n_layer=sf.hparams.n_layer, n_head=d.n_head or target_hp.n_head,
        n_head_kv=d.n_head_kv or target_hp.n_head_kv, head_dim=hd, head_dim_v=hd,
        n_ff=d.n_ff or target_hp.n_ff, rms_eps=d.rms_eps or target_hp.rms_eps,
        rope_freq_base=d.rope_base or target_hp.rope_freq_base, n_rot=hd)


def _dspark_from_support(sf, target_hp: HParams, int8: str, model=None) -> DSparkWeights:
    hp_s = sf.hparams
    if hp_s.layout != "llama.cpp" and model is not None:
        own = model.load_ds4_dspark(sf, int8)
        if own is not None:  # DeepSeek V4: ds4's own DSpark file (stages mtp.0..)
            return own
    if hp_s.layout != "llama.cpp":
        raise UsageError(about(sf.path, f"is a DSpark support file in ds4's DeepSeek V4 layout "
                                        f"({sf.architecture}); the engine runs DSpark drafts for "
                                        f"llama/qwen3 targets in llama.cpp's layout (dflash)"))
    if not hp_s.sample_from_anchor:
        raise UsageError(about(sf.path, "dflash.sample_from_anchor is false (the 1+N block layout); "
                                        "the engine runs anchor-first DSpark blocks"))
    hp = _draft_hparams(target_hp, sf)
    t = sf.gguf.tensors
    H, r, V = hp.n_embd, hp_s.markov_rank, target_hp.n_vocab
    n_t = len(hp_s.target_layers)
    conf_w = conf_b = None
    if "conf_proj.weight" in t:
        conf_w = _linear(t, "conf_proj.weight", 1, H + r, "none").dequantize()[0].astype("float64")
        conf_b = float(_vector(t, "conf_proj.bias", 1)[0]) if "conf_proj.bias" in t else 0.0
    return DSparkWeights(
        fc=_linear(t, "fc.weight", H, n_t * H, int8),
        hidden_norm=_vector(t, "enc.output_norm.weight", H),
        layers=[load_layer(t, f"blk.{i}.", hp, int8) for i in range(hp_s.n_layer)],
        norm=_vector(t, "output_norm.weight", H),
        markov_w1=_linear(t, "markov_w1.weight", V, r, "none"),
        markov_w2=_linear(t, "markov_w2.weight", V, r, int8),
        conf_w=conf_w, conf_b=conf_b or 0.0, hparams=hp, block_size=hp_s.block_size,
        markov_rank=r, mask_token_id=hp_s.mask_token_id,
        target_layers=tuple(hp_s.target_layers), source=f"{sf.path}, {len(t)} tensors")


def open_support_for(path, target_path, target_hp: HParams, int8: str, model=None):
    """(kind, weights) for a support GGUF checked against the target: "mtp" -> MtpHeadWeights,
    "dspark" -> DSparkWeights. Problems raise the errors ``inspect`` reports. A GGUF of a model
    architecture with NextN layers (llama.cpp's MTP-only file) is an MTP head too, its layer
    loaded by ``model``'s architecture."""
    f = _open_nextn_file(path)
    if f is not None:
        return "mtp", _mtp_from_llamacpp(f, target_path, target_hp, int8, model)
    # runtime="ds4tools": a draft that only llama.cpp cannot run (it reads the target's last
    # layer, which llama.cpp's llama/qwen3 graphs do not expose) runs here
    sf = open_support(path, target=target_path, runtime="ds4tools")
    try:
        if sf.kind == MTP_KIND:
            return "mtp", _mtp_from_support(sf, target_hp, int8, model)
        return "dspark", _dspark_from_support(sf, target_hp, int8, model)
    except WeightsError as err:
        raise InvalidContentError(about(sf.path, str(err))) from None
