"""Plug the support GGUF kinds into ``ds4tools inspect``: their detectors, checks, the ds4
summary line, the ``--target`` pair check, and the check of NextN layers embedded in a model.
Imported by ds4tools.inspect."""
from __future__ import annotations

from ..errors import UsageError, about
from ..inspect.kinds import register_kind, register_summary
from ..inspect.validate import Finding, check_vocab, register_check, register_target_check
from . import nextn
from .detect import DRAFT, DSPARK, MIXED, MTP, UNKNOWN, detect
from .target import open_target
from .validate import summary_lines, validate_support

_KINDS = {
    MTP: "MTP head support file (ds4 layout, mtp.0.*)",
    DSPARK: "DSpark draft support file (ds4 layout, mtp.0..2.*)",
    DRAFT: "DSpark draft (llama.cpp layout, architecture dflash)",
    MIXED: "support tensors of more than one layout (invalid)",
    UNKNOWN: "support tensors that fit no layout (invalid)",
}


def _findings(problems) -> list[Finding]:
    return [Finding(p.level, p.message) for p in problems]


def _register(kind: str, description: str) -> None:
    # after vocab-only (support files always have tensors), before the generic model
    register_kind(kind, order=85, description=description)(lambda f: detect(f).kind == kind)
    register_check(kind)(lambda f: _findings(validate_support(f, kind)))
    register_summary(kind)(lambda f: summary_lines(f, kind))

    @register_target_check(kind)
    def _pair(f, target_path: str) -> list[Finding]:
        # only what the pair adds: the file's own findings are already reported
        alone = {(p.level, p.message) for p in validate_support(f, kind)}
        paired = validate_support(f, kind, open_target(target_path))
        return [Finding(p.level, p.message) for p in paired if (p.level, p.message) not in alone]


for _kind, _description in _KINDS.items():
    _register(_kind, _description)

register_check(DRAFT)(check_vocab)  # llama.cpp loads the draft's own vocabulary


@register_target_check("*")
def _not_support(f, target_path: str) -> list[Finding]:
    # asking to pair a file that is no support GGUF is a wrong command, not a wrong file: exit 2
    det = detect(f)
    raise UsageError(about(f.path, f"--target {target_path}: this is not a support GGUF; it is "
                                   f"{det.found}"))


@register_check("model")
def _embedded_nextn(f) -> list[Finding]:
    if nextn.is_trunk_only(f):
        e = nextn.find(f)
        return [Finding("warning", f"{e.arch}.nextn_predict_layers is {e.n_nextn} but the NextN "
                                   f"tensors are not in this file (llama.cpp's trunk-only layout: "
                                   f"they are in the MTP-only file split from the same checkpoint)")]
    return _findings(nextn.validate(f))
