"""Which drafter runs, from ds4's flags, with the wrong combinations refused up front.

    --mtp FILE                 an MTP head (ds4's mtp.0.* support GGUF, or for glm4moe / deepseek2
                               llama.cpp's MTP-only file), or with --dspark a DSpark draft
    --mtp-draft N, --mtp-margin F     MTP: drafts per step (1..16), top-1 minus top-2 logit floor
    --glm-mtp                  the NextN layer embedded in the model GGUF instead of a file
    --glm-mtp-timing           per-step timing and acceptance on stderr (alone: implies --glm-mtp)
    --dspark                   the DSpark draft given with --mtp
    --dspark-block-size N, --dspark-confidence F, --dspark-strict     (each implies --dspark)
    --lookup N                 prompt lookup (n-gram copy), no model
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError, about


@dataclass
class SpecConfig:
    mtp_file: str | None = None
    glm_mtp: bool = False
    dspark: bool = False
    mtp_draft: int | None = None        # None: the default (3)
    mtp_margin: float | None = None     # None: off
    dspark_block_size: int | None = None
    dspark_confidence: float | None = None
    dspark_strict: bool = False
    lookup: int | None = None
    timing: bool = False

    DEFAULT_MTP_DRAFT = 3

    def resolved(self, temperature: float) -> "SpecConfig":
        """Check the combination; returns a copy with implied flags set. Raises UsageError."""
        c = SpecConfig(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        if c.dspark_block_size is not None or c.dspark_confidence is not None or c.dspark_strict:
            c.dspark = True  # as ds4: each DSpark option implies --dspark
        model_paths = [n for n, on in (("--mtp FILE", c.mtp_file is not None and not c.dspark),
                                       ("--glm-mtp", c.glm_mtp), ("--dspark", c.dspark),
                                       ("--lookup", c.lookup is not None)) if on]
        if c.timing and not model_paths:
            c.glm_mtp = True  # ds4's --glm-mtp-timing enables the embedded MTP
            model_paths = ["--glm-mtp"]
        if len(model_paths) > 1:
            if c.glm_mtp and c.mtp_file is not None:
                raise UsageError("--glm-mtp uses the NextN layers inside the model GGUF; it takes no "
                                 "--mtp FILE")
            raise UsageError(f"choose one drafting path, not {' and '.join(model_paths)}")
        mtp = (c.mtp_file is not None and not c.dspark) or c.glm_mtp
        if not mtp and (c.mtp_draft is not None or c.mtp_margin is not None):
            raise UsageError("--mtp-draft and --mtp-margin apply to MTP drafting (--mtp FILE or --glm-mtp)")
        if c.mtp_draft is not None and not 1 <= c.mtp_draft <= 16:
            raise UsageError(f"--mtp-draft {c.mtp_draft}: must be in 1..16")
        if c.mtp_margin is not None and not c.mtp_margin >= 0:
            raise UsageError(f"--mtp-margin {c.mtp_margin}: must not be negative (0 = off)")
        if c.dspark_confidence is not None and not 0.0 <= c.dspark_confidence <= 1.0:
            raise UsageError(f"--dspark-confidence {c.dspark_confidence}: must be in 0..1 (0 = no cut)")
        if c.dspark_block_size is not None and c.dspark_block_size < 1:
            raise UsageError(f"--dspark-block-size {c.dspark_block_size}: must be at least 1")
        if c.lookup is not None and not 1 <= c.lookup <= 64:
            raise UsageError(f"--lookup {c.lookup}: must be in 1..64")
        if c.dspark_strict and temperature > 0:
            raise UsageError("--dspark-strict is lossless only at --temp 0: with sampling, dropping "
                             "an accepted prefix after a later rejection biases the output "
                             "distribution; use --temp 0 or drop --dspark-strict")
        return c

    @property
    def active(self) -> bool:
        """Whether any speculative flag was given (resolved() then checks the combination).

        By identity, not equality: ``0 == False``, and a value of 0 (``--lookup 0``,
        ``--dspark-confidence 0``) is a given flag that resolved() must see."""
        return any(getattr(self, k) is not None and getattr(self, k) is not False
                   for k in self.__dataclass_fields__)


def build_drafter(engine, config: SpecConfig):
    """The drafter ``config`` asks for, on ``engine``'s target (None: plain decoding).

    ``config`` must be resolved; --dspark takes its draft from --mtp FILE (without -m, the
    commands fill in the bundled demo's: ``ds4tools.demo.resolve_model``)."""
    from .dspark import DSparkDrafter
    from .load import mtp_from_nextn, open_support_for
    from .lookup import PromptLookupDrafter
    from .mtp import MtpDrafter

    int8 = "none" if engine.exact else engine.int8_mode
    if config.lookup is not None:
        return PromptLookupDrafter(config.lookup)
    depth = config.mtp_draft or SpecConfig.DEFAULT_MTP_DRAFT
    margin = config.mtp_margin or 0.0
    arch = getattr(engine, "architecture", None)
    if config.dspark and arch is not None and not arch.dspark_drafts:
        raise UsageError(about(engine.path, f"drafting with a model (--dspark) is not available for "
                                            f"{engine.hparams.arch} models yet; --glm-mtp, --mtp FILE "
                                            f"(an MTP head) and --lookup N work"))
    if config.glm_mtp:
        return MtpDrafter(engine.model, mtp_from_nextn(engine.gguf, engine.hparams, int8, engine.model),
                          depth, margin)
    path = config.mtp_file
    if config.dspark and path is None:
        raise UsageError("--dspark needs the DSpark draft: --mtp DRAFT.gguf")
    if path is None:
        return None
    kind, weights = open_support_for(path, engine.path, engine.hparams, int8, engine.model)
    if config.dspark and kind != "dspark":
        raise UsageError(about(path, "is an MTP head, not a DSpark draft: drop --dspark "
                                     "(and the --dspark-* options) to draft with it"))
    if not config.dspark and kind == "dspark":
        raise UsageError(about(path, "is a DSpark draft: add --dspark to draft with it"))
    if kind == "mtp":
        return MtpDrafter(engine.model, weights, depth, margin)
    try:
        return DSparkDrafter(engine.model, weights, config.dspark_block_size,
                             config.dspark_confidence or 0.0)
    except ValueError as e:
        raise UsageError(str(e)) from None
