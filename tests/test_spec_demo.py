"""Speculative decoding on the trained demo model (ds4tools/data/demo): every drafter and setting
gives exactly plain greedy decoding's tokens over held-out prompts, and really drafts (a test
that accepted nothing would prove nothing)."""
import json
from pathlib import Path

import numpy as np
import pytest

import ds4tools
from ds4tools.engine import Engine
from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import PromptLookupDrafter, SpecStats, speculative_decode
from ds4tools.engine.speculative.config import SpecConfig, build_drafter

DEMO = Path(ds4tools.__file__).parent / "data" / "demo"
pytestmark = pytest.mark.skipif(
    not (DEMO / "target" / "model.safetensors").exists() or not (DEMO / "dspark" / "model.safetensors").exists(),
    reason="the demo model (ds4tools/data/demo) is not installed")

N_PROMPTS, N_TOKENS = 10, 128
GREEDY = Sampler(temperature=0.0)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's GGUFs, converted into a private cache: target, MTP head, DSpark draft, and the
    target with its NextN layer embedded."""
    import os
    from ds4tools.demo import demo_model_path, demo_support_path
    old = os.environ.get("DS4TOOLS_CACHE")
    os.environ["DS4TOOLS_CACHE"] = str(tmp_path_factory.mktemp("demo-cache"))
    try:
        files = {"target": demo_model_path(progress=False)}
        for kind in ("mtp", "dspark", "nextn"):
            files[kind] = demo_support_path(kind)
    finally:
        if old is None:
            os.environ.pop("DS4TOOLS_CACHE")
        else:
            os.environ["DS4TOOLS_CACHE"] = old
    eng = Engine(str(files["target"]))
    prompts = [p["text"] for p in json.loads((DEMO / "prompts.json").read_text())][:N_PROMPTS]
    ids = [eng.prompt_tokens(p) for p in prompts]
    plain = [list(decode(eng.model, x, N_TOKENS, GREEDY, np.random.default_rng(0), frozenset()))
             for x in ids]
    return eng, files, ids, plain


def _run(eng, drafter, ids, strict=False):
    total = SpecStats(method=drafter.name)
    outs = []
    for x in ids:
        st = SpecStats(method=drafter.name)
        outs.append(list(speculative_decode(eng.model, drafter, x, N_TOKENS, GREEDY,
                                            np.random.default_rng(0), frozenset(), spec=st,
                                            strict=strict, calibrate=False)))
        total.merge(st)
    return outs, total


def _drafter(eng, files, **cfg):
    if cfg.get("dspark"):
        cfg["mtp_file"] = str(files["dspark"])
    elif "mtp_draft" in cfg:
        cfg["mtp_file"] = str(files["mtp"])
    return build_drafter(eng, SpecConfig(**cfg).resolved(temperature=0.0))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("margin", [0.0, 2.0])
def test_mtp_greedy_is_plain_greedy(demo, n, margin):
    eng, files, ids, plain = demo
    outs, st = _run(eng, _drafter(eng, files, mtp_draft=n, mtp_margin=margin or None), ids)
    assert outs == plain
    assert st.accepted > 0, st.as_dict()


@pytest.mark.parametrize("block", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cut", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("strict", [False, True])
def test_dspark_greedy_is_plain_greedy(demo, block, cut, strict):
    eng, files, ids, plain = demo
    drafter = _drafter(eng, files, dspark=True, dspark_block_size=block, dspark_confidence=cut or None)
    outs, st = _run(eng, drafter, ids, strict=strict)
    assert outs == plain
    assert st.accepted > 0, st.as_dict()
    if cut >= 0.7:
        assert st.confidence_cuts > 0


def test_embedded_nextn_and_lookup_greedy_are_plain_greedy(demo):
    eng, files, ids, plain = demo
    nextn = Engine(str(files["nextn"]))
    outs, st = _run(nextn, build_drafter(nextn, SpecConfig(glm_mtp=True).resolved(0.0)), ids)
    assert outs == plain and st.accepted > 0
    outs, st = _run(eng, PromptLookupDrafter(8), ids)
    assert outs == plain and st.accepted > 0
