"""The speculative settings a ``ds4tools bench`` sweep runs: the drafter options' comma lists,
expanded into one ``SpecConfig`` per setting and checked with ``run``'s rules before any model
is loaded.

    --lookup 4,8                                   lookup=4, lookup=8
    --mtp MTP.gguf --mtp-draft 1,2 --mtp-margin 0,3   MTP: every draft depth x margin
    --glm-mtp --mtp-draft 1,2,3                    MTP with the NextN layer inside the model
    --dspark [--mtp DRAFT.gguf] --dspark-block-size 4,8 --dspark-confidence 0,0.5
                                                   DSpark: every block size x confidence cut

Families combine in one run (each gets its own rows); ``--mtp FILE`` is the MTP head, or with
``--dspark`` (or any ``--dspark-*`` option) the DSpark draft, as in ``ds4tools run``: an MTP
file and a DSpark file need two runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.speculative.config import SpecConfig
from ..errors import UsageError


@dataclass
class DrafterLists:
    """The drafter options as given: a list for each sweepable value, None when absent."""
    mtp_file: str | None = None
    glm_mtp: bool = False
    dspark: bool = False
    mtp_draft: list | None = None
    mtp_margin: list | None = None
    dspark_block_size: list | None = None
    dspark_confidence: list | None = None
    dspark_strict: bool = False
    lookup: list | None = None

    @property
    def wants_dspark(self) -> bool:
        return (self.dspark or self.dspark_strict or self.dspark_block_size is not None
                or self.dspark_confidence is not None)


@dataclass(frozen=True)
class Setting:
    """One speculative configuration of the sweep."""
    family: str                    # "lookup" | "mtp" | "dspark"
    label: str                     # what the table's spec column shows, e.g. "dspark b=4 c=0.5"
    config: SpecConfig = field(compare=False)
    params: dict = field(compare=False, default_factory=dict)   # the swept values, for JSON


def _lookup(lists: DrafterLists) -> list[Setting]:
    return [Setting("lookup", f"lookup={n}", SpecConfig(lookup=n), {"lookup": n})
            for n in lists.lookup or []]


def _mtp(lists: DrafterLists) -> list[Setting]:
    file = None if lists.wants_dspark else lists.mtp_file
    if not (lists.glm_mtp or file is not None):
        if lists.mtp_draft is not None or lists.mtp_margin is not None:
            extra = " (with --dspark, --mtp FILE is the DSpark draft)" if lists.mtp_file else ""
            raise UsageError("--mtp-draft and --mtp-margin apply to MTP drafting (--mtp FILE or "
                             "--glm-mtp)" + extra)
        return []
    name = "glm-mtp" if lists.glm_mtp else "mtp"
    out = []
    for depth in lists.mtp_draft or [None]:
        for margin in lists.mtp_margin or [None]:
            label = name + (f" n={depth}" if depth is not None else "") \
                + (f" m={margin:g}" if margin is not None else "")
            cfg = SpecConfig(mtp_file=file, glm_mtp=lists.glm_mtp, mtp_draft=depth, mtp_margin=margin)
            out.append(Setting("mtp", label, cfg, {"glm_mtp": lists.glm_mtp, "mtp_draft": depth,
                                                   "mtp_margin": margin}))
    return out


def _dspark(lists: DrafterLists) -> list[Setting]:
    if not lists.wants_dspark:
        return []
    out = []
    for block in lists.dspark_block_size or [None]:
        for conf in lists.dspark_confidence or [None]:
            label = "dspark" + (f" b={block}" if block is not None else "") \
                + (f" c={conf:g}" if conf is not None else "") + (" strict" if lists.dspark_strict else "")
            cfg = SpecConfig(mtp_file=lists.mtp_file, dspark=True, dspark_block_size=block,
                             dspark_confidence=conf, dspark_strict=lists.dspark_strict)
            out.append(Setting("dspark", label, cfg, {"dspark_block_size": block,
                                                      "dspark_confidence": conf,
                                                      "dspark_strict": lists.dspark_strict}))
    return out


def expand(lists: DrafterLists, temperatures) -> list[Setting]:
    """Every setting of the sweep (empty: no sweep), each checked at every temperature with
    ``SpecConfig.resolved`` (ranges, --dspark-strict with sampling...). Raises UsageError."""
    if lists.glm_mtp and lists.mtp_file is not None and not lists.wants_dspark:
        raise UsageError("--glm-mtp uses the NextN layers inside the model GGUF; it takes no --mtp FILE")
    settings = _lookup(lists) + _mtp(lists) + _dspark(lists)
    for s in settings:
        for t in temperatures:
            s.config.resolved(temperature=t)
    return settings
