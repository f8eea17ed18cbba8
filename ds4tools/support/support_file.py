"""``SupportFile``: an opened, validated support GGUF as the engine loads it: its kind, its
hyper-parameters, and its tensors by role (memory-mapped ``TensorRef``s, never copied).

    >>> s = open_support("draft.gguf", target="model.gguf")
    >>> s.kind, s.hparams.block_size, s.hparams.target_layers
    >>> w1 = s.tensor("markov_w1")            # a TensorRef
    >>> q = s.tensor("attn_q", layer=0)       # per-layer roles take the layer (or stage)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import InvalidContentError, about
from ..gguf_io import GGUFFile, TensorRef, open_gguf
from . import dspark_ds4, dspark_llamacpp, mtp
from .detect import DRAFT, DSPARK, ERROR_KINDS, MTP, detect
from .layout import Problems
from .target import Dims, TargetInfo, open_target
from .validate import validate_support

__all__ = ["SupportFile", "SupportHparams", "open_support"]


@dataclass
class SupportHparams:
    """What the engine needs to run a support file (None: does not apply to this kind)."""
    kind: str
    layout: str  # "ds4" or "llama.cpp"
    dims: Dims  # the target's dimensions as the file describes them (or as its tensors imply)
    target_arch: str | None = None
    n_layer: int = 0  # MTP layers / DSpark stages / draft layers in the file
    block_size: int | None = None
    markov_rank: int | None = None
    mask_token_id: int | None = None  # DSpark's mask (noise) token
    #: target layers whose *outputs* feed the draft (DeepSpec numbering; -1: the embedding)
    target_layers: list[int] = field(default_factory=list)
    sample_from_anchor: bool = True
    nextn_layer_index: int | None = None
    #: the draft backbone (llama.cpp layout): heads, head dim, feed-forward, norms, rope
    draft: Dims | None = None


@dataclass
class SupportFile:
    path: str
    kind: str
    architecture: str | None
    hparams: SupportHparams
    gguf: GGUFFile
    problems: Problems
    #: role key ("markov_w1", "fc", "3.attn_q" for layer / stage 3...) -> tensor
    roles: dict[str, TensorRef]

    def tensor(self, role: str, layer: int | None = None) -> TensorRef:
        key = role if layer is None else f"{layer}.{role}"
        try:
            return self.roles[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor for role '{key}'") from None

    def has(self, role: str, layer: int | None = None) -> bool:
        return (role if layer is None else f"{layer}.{role}") in self.roles

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> "SupportFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_INDEXED = re.compile(r"^(?:blk|mtp)\.(\d+)\.")


def _roles(f: GGUFFile, specs) -> dict[str, TensorRef]:
    """Role keys: the bare role for tensors that occur once, "<i>.<role>" for per-layer ones
    (DSpark stages' head tensors also get their bare role)."""
    out = {}
    for s in specs:
        t = f.tensors.get(s.name)
        if t is None:
            continue
        m = _INDEXED.match(s.name)
        if m and s.name.startswith("blk."):
            out[f"{m.group(1)}.{s.role}"] = t
        elif m and s.name.startswith("mtp.") and f"{m.group(1)}.{s.role}" not in out:
            out[f"{m.group(1)}.{s.role}"] = t
            out.setdefault(s.role, t)
        else:
            out[s.role] = t
    return out


def _hparams_mtp(f: GGUFFile):
    target_arch, own, nextn, _ = mtp.read_metadata(f)
    dsv4 = mtp.is_dsv4_file(f, target_arch)
    dims = own.merged(mtp.infer_dims(f, dsv4))
    specs = mtp.specs(dims, target_arch, dsv4, (mtp.PREFIX + "attn_q_norm.weight") in f.tensors)
    return SupportHparams(MTP, "ds4", dims, target_arch=target_arch, n_layer=1,
                          nextn_layer_index=nextn), specs


def _hparams_dspark(f: GGUFFile, target: TargetInfo | None):
    s = dspark_ds4.Summary(f)
    dims = dspark_ds4.expected_dims(f, s, target)
    specs = dspark_ds4.specs(dims, s.stages_checked, len(s.target_layers or []), s.markov_rank or 0,
                             f.architecture != dspark_ds4.ARCH_V41)
    return SupportHparams(DSPARK, "ds4", dims, target_arch=f.architecture, n_layer=s.stages,
                          block_size=s.block_size, markov_rank=s.markov_rank,
                          mask_token_id=s.noise_token_id,
                          target_layers=list(s.target_layers or [])), specs


def _hparams_draft(f: GGUFFile, target: TargetInfo | None):
    h = dspark_llamacpp.DraftHparams(f)
    h.n_layer = min(h.n_layer or 0, dspark_llamacpp.blocks_present(f))
    draft = Dims(n_embd=h.n_embd, n_vocab=h.n_vocab, n_layer=h.n_layer, n_head=h.n_head,
                 n_head_kv=h.n_head_kv, head_dim=h.head_dim, n_ff=h.n_ff, rope_base=h.rope_base,
                 rms_eps=h.rms_eps, context_length=h.context_length)
    dims = Dims(n_embd=h.target_hidden_size or h.n_embd, n_vocab=h.n_vocab)
    if target is not None:
        dims = dims.merged(target.dims)
    specs = dspark_llamacpp.specs(h, h.n_embd, h.n_vocab)
    layers = dspark_llamacpp.from_llama_layers(h.target_layers or [])
    return SupportHparams(DRAFT, "llama.cpp", dims, target_arch=None, n_layer=h.n_layer or 0,
                          block_size=h.block_size, markov_rank=h.markov_rank,
                          mask_token_id=h.mask_token, target_layers=layers,
                          sample_from_anchor=h.sample_from_anchor, draft=draft), specs


def open_support(path, target=None, *, strict: bool = True, runtime: str | None = None) -> SupportFile:
    """Open and validate a support GGUF (``target``: a path or TargetInfo to check the pair).

    Raises ``InvalidContentError`` naming the first problem (all of them in ``.findings``) when
    the file is not a support file or, with ``strict``, when it has errors. ``runtime``
    ("ds4tools": the engine) ignores the errors that stop only another program (a draft
    reading the target's last layer, which llama.cpp cannot capture); they stay in
    ``.problems``."""
    path = os.fspath(path)
    if target is not None and not isinstance(target, TargetInfo):
        target = open_target(target)
    f = open_gguf(path)
    det = detect(f)
    if det.kind is None or det.kind in ERROR_KINDS:
        what = "not a usable support GGUF: it holds" if det.kind else "not a support GGUF: it is"
        raise InvalidContentError(about(path, f"{what} {det.found}"))
    problems = validate_support(f, det.kind, target)
    errors = problems.errors_for(runtime)
    if strict and errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidContentError(about(path, errors[0] + more),
                                  findings=[about(path, m) for m in errors])
    if det.kind == MTP:
        hp, specs = _hparams_mtp(f)
    elif det.kind == DSPARK:
        hp, specs = _hparams_dspark(f, target)
    else:
        hp, specs = _hparams_draft(f, target)
    return SupportFile(path, det.kind, f.architecture, hp, f, problems, _roles(f, specs))
