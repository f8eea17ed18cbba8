"""What kind of support GGUF a file is.

- ds4's rule (support_model_detect): tensors named ``mtp.<N>.``; stages = max N + 1; the file is
  a **DSpark** support file iff stages >= 3 and it has ``.main_proj.``, ``.markov_head.`` and
  ``.confidence_head.`` tensors;
- an **MTP** support file has the MTP-only tensors (``mtp.N.e_proj`` / ``h_proj`` / ``enorm`` /
  ``hnorm``) and none of DSpark's;
- llama.cpp's DSpark **draft**: architecture ``dflash`` (or ``dspark``), with ``markov_w1``;
- both MTP-only and DSpark tensors (or ds4 and llama.cpp layouts together): **mixed**, an error;
- ``mtp.*`` tensors, or a support architecture, that fit none of the above: an error that says
  what was found.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dspark_ds4, dspark_llamacpp, mtp

__all__ = ["Detection", "detect", "MTP", "DSPARK", "DRAFT", "MIXED", "UNKNOWN", "SUPPORT_KINDS",
           "ERROR_KINDS"]

MTP, DSPARK, DRAFT = "mtp-support", "dspark-support", "dspark-draft"
MIXED, UNKNOWN = "mixed-support", "unknown-support"
SUPPORT_KINDS = (MTP, DSPARK, DRAFT)
ERROR_KINDS = (MIXED, UNKNOWN)
_MTP_ONLY = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
_DSPARK_MARKS = (".main_proj.", ".markov_head.", ".confidence_head.")


@dataclass(frozen=True)
class Detection:
    kind: str | None  # None: not a support file at all
    layout: str | None  # "ds4" or "llama.cpp"
    found: str  # what the file holds, in words (for error messages)


def _staged(names) -> list[str]:
    return [n for n in names if dspark_ds4._stage(n) is not None]


def _examples(names, limit=2) -> str:
    names = list(names)
    more = ", ..." if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def detect(f) -> Detection:
    names = list(f.tensors)
    arch = f.architecture or ""
    staged = _staged(names)
    mtp_only = [n for n in staged if n.split(".", 2)[2] in _MTP_ONLY]
    dspark = [n for n in staged if any(m in n for m in _DSPARK_MARKS)]
    if arch in dspark_llamacpp.ARCHS:
        if staged:
            return Detection(MIXED, None, f"a llama.cpp {arch} draft that also holds ds4 "
                                          f"mtp.* tensors ({_examples(staged)})")
        return Detection(DRAFT, "llama.cpp", f"a llama.cpp {arch} draft")
    if staged:
        s = dspark_ds4.Summary(f)
        if mtp_only and dspark:
            return Detection(MIXED, None, f"both MTP-only tensors ({_examples(mtp_only)}) and "
                                          f"DSpark tensors ({_examples(dspark)})")
        if "markov_w1.weight" in names or "fc.weight" in names:
            return Detection(MIXED, None, f"ds4 mtp.* tensors ({_examples(staged)}) together "
                                          f"with llama.cpp draft tensors (markov_w1 / fc)")
        if s.is_dspark:
            return Detection(DSPARK, "ds4", f"a ds4 DSpark support file ({s.stages} stages)")
        if mtp_only:
            return Detection(MTP, "ds4", f"an MTP support file ({s.stages} stage(s))")
        yn = lambda b: "yes" if b else "no"  # noqa: E731
        return Detection(UNKNOWN, None, (
            f"mtp.* tensors for {s.stages} stage(s), but neither an MTP head (no e_proj, h_proj, "
            f"enorm or hnorm) nor a DSpark draft (at least 3 stages with main_proj, markov_head "
            f"and confidence_head: main_proj={yn(s.has_main_proj)}, "
            f"markov_head={yn(s.has_markov_head)}, confidence_head={yn(s.has_confidence_head)})"))
    if arch.endswith(mtp.ARCH_SUFFIX) or arch in dspark_ds4.ARCHS:
        return Detection(UNKNOWN, None, f"architecture '{arch}' but no mtp.* tensors "
                                        f"({len(names)} tensors)")
    if "markov_w1.weight" in names:
        return Detection(UNKNOWN, None, f"markov_w1.weight in a '{arch or '(no architecture)'}' "
                                        f"file: llama.cpp's DSpark drafts are architecture dflash")
    return Detection(None, None, f"a {arch or '(no architecture)'} file with {len(names)} "
                                 f"tensors and no support tensors (mtp.*, markov_w1)")
