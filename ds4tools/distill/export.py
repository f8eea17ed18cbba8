"""Write a trained draft through the support writers (``ds4tools.support.build``): a DSpark draft
in llama.cpp's dflash layout (which the engine runs with ``--mtp OUT --dspark``), an MTP head as
ds4's dense MTP support file (``--mtp OUT``). The writer refuses target layers llama.cpp cannot
capture; the file is written to a temporary name and renamed into place.
"""
from __future__ import annotations

import os

from gguf import GGUFValueType as V

from ..gguf_io import MetaKey

__all__ = ["write_draft"]


def write_draft(kind: str, module, target, path: str, cfg: dict, type_name: str = "Q8_0", *,
                overwrite: bool = False, progress=None, extra=()):
    from .. import formats
    from ..mixes import resolve_target
    from ..support.build import dspark_draft_from_arrays, mtp_from_arrays
    from ..support.target import Dims, open_target
    from ..support.write import write_support_gguf
    out_type = resolve_target(type_name, list(formats.FORMATS))
    info = open_target(target.path)
    hp = target.hp
    name = f"{os.path.basename(target.path)} {kind} draft (ds4tools distill)"
    keys = [MetaKey("general.name", name, V.STRING), *extra]
    try:
        if kind == "dspark":
            from .dspark import export_arrays
            draft = Dims(n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv,
                         head_dim=hp.head_dim, n_ff=hp.n_ff, rope_base=hp.rope_freq_base,
                         rms_eps=hp.rms_eps, context_length=hp.n_ctx_train)
            built = dspark_draft_from_arrays(
                export_arrays(module), info, out_type, draft=draft, n_layer=cfg["layers"],
                block_size=cfg["block_size"], target_layers=cfg["target_layers"],
                mask_token_id=cfg["mask_token_id"], name=name, extra_keys=keys[1:])
        else:
            from .mtp import export_arrays
            built = mtp_from_arrays(export_arrays(module), info, out_type, name=name,
                                    extra_keys=keys[1:])
        return write_support_gguf(path, built.arch, built.keys, built.tensors, where=target.path,
                                  inputs=[target.path], overwrite=overwrite, progress=progress,
                                  file_type=out_type.ftype)
    finally:
        if info.gguf is not None:
            info.gguf.close()
