"""Support GGUFs for speculative decoding: MTP heads and DSpark drafts, written (by
``ds4tools quantize``), validated (by ``ds4tools inspect``) and opened for the engine.

Layouts (docs/support-gguf.md has every key and tensor):

- ``mtp-support``: ds4's MTP support file, one NextN/MTP layer under ``mtp.0.`` (module ``mtp``);
- ``dspark-support``: ds4's DSpark support file, three DeepSeek V4 stages (``dspark_ds4``);
- ``dspark-draft``: llama.cpp's DSpark draft, architecture ``dflash`` (``dspark_llamacpp``);
- embedded NextN layers inside a model GGUF (``nextn``).

    >>> from ds4tools.support import open_support
    >>> s = open_support("draft.gguf", target="model.gguf")   # raises on invalid files
    >>> s.kind, s.hparams.block_size, s.tensor("markov_w1")
"""
from .detect import DRAFT, DSPARK, MTP, Detection, detect
from .layout import Problem, Problems
from .support_file import SupportFile, SupportHparams, open_support
from .target import Dims, TargetInfo, open_target
from .validate import summary_lines, validate_support

__all__ = ["open_support", "SupportFile", "SupportHparams", "detect", "Detection",
           "validate_support", "summary_lines", "open_target", "TargetInfo", "Dims", "Problem",
           "Problems", "MTP", "DSPARK", "DRAFT"]
