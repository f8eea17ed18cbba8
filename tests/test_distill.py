"""`ds4tools distill` end to end on tiny targets (seconds): a DSpark draft and an MTP head are
trained, written, accepted by `inspect --target`, run by `ds4tools run` with greedy output equal
to plain decoding, measured (figures in the metadata and the JSON report); an interrupted or
killed run resumes to the same weights as an uninterrupted one."""
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch", reason="ds4tools distill trains with PyTorch: pip install 'ds4tools[train]'")

from ds4tools.cli import main  # noqa: E402
from ds4tools.distill import DistillOptions, distill  # noqa: E402
from ds4tools.gguf_io import open_gguf  # noqa: E402
from tests.fixtures.hf_models import corpus_text  # noqa: E402
from tests.reference_model import RefConfig, write_random_model  # noqa: E402

QWEN3 = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
LLAMA = RefConfig("llama", n_vocab=300, n_embd=64, n_layer=3, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
SMALL = ["--windows", 6, "--seq-len", 64, "--batch", 2, "--anchors", 4, "--eval-anchors", 24,
         "--eval-tokens", 12, "--threads", 1]
PROMPT = "Return the value of a and b"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    write_random_model(d / "qwen3.gguf", QWEN3, seed=5, default_type="Q8_0")
    write_random_model(d / "llama.gguf", LLAMA, seed=6, default_type="Q8_0")
    (d / "text").mkdir()
    for i in range(6):
        (d / "text" / f"part{i}.txt").write_text(corpus_text(60, seed=i), encoding="utf-8")
    return d


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def run_text(*args):
    r = cli("run", *args, "-p", PROMPT, "-n", 24, "--temp", 0, "--threads", 1)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def test_dspark_draft_end_to_end(files, tmp_path):
    out = tmp_path / "draft.gguf"
    r = cli("distill", files / "qwen3.gguf", "--kind", "dspark", "-o", out, "--data", files / "text",
            "--self-generate", 2, "--steps", 30, *SMALL)
    assert r.exit_code == 0, r.stderr
    assert "held-out tau" in r.stdout and str(out) in r.stdout
    # nothing else is left beside the output: the run directory was temporary
    assert sorted(os.listdir(tmp_path)) == ["draft.distill.json", "draft.gguf"]
    report = json.loads((tmp_path / "draft.distill.json").read_text())
    assert report["kind"] == "dspark" and report["training"]["steps"] == 30
    assert report["draft"]["target_layers"] == [1, 2] and report["draft"]["dflash_target_layers"] == [2, 3]
    assert report["data"]["self_generated_windows"] == 2 and report["data"]["text_windows"] == 6
    hist = report["training"]["history"]
    assert hist[0]["step"] == 1 and hist[-1]["step"] == 30 and hist[-1]["loss"] < hist[0]["loss"]
    ev = report["evaluation"]
    assert ev["heldout"]["dspark"]["n"] > 0 and ev["heldout"]["prompt_lookup"]["n"] == ev["heldout"]["dspark"]["n"]
    assert ev["prompts"]["greedy_identical_to_plain"] is True
    md = open_gguf(out).metadata
    assert md["general.architecture"] == "dflash" and list(md["dflash.target_layers"]) == [2, 3]
    assert md["distill.kind"] == "dspark" and md["distill.steps"] == 30
    assert md["distill.heldout.tau"] == pytest.approx(ev["heldout"]["dspark"]["tau"], abs=1e-6)
    assert md["distill.heldout.prompt_lookup_tau"] == pytest.approx(ev["heldout"]["prompt_lookup"]["tau"], abs=1e-6)
    r = cli("inspect", out, "--target", files / "qwen3.gguf")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "target_layers=1,2" in r.stdout
    # the engine drafts with it, and greedy output is plain decoding's
    plain = run_text("-m", files / "qwen3.gguf")
    assert run_text("-m", files / "qwen3.gguf", "--mtp", out, "--dspark") == plain


def test_mtp_head_end_to_end_on_a_llama_target_with_a_time_budget(files, tmp_path):
    out = tmp_path / "mtp.gguf"
    r = cli("distill", files / "llama.gguf", "--kind", "mtp", "-o", out, "--data", files / "text",
            "--time", "4s", *SMALL)
    assert r.exit_code == 0, r.stderr
    report = json.loads((tmp_path / "mtp.distill.json").read_text())
    t = report["training"]
    assert t["steps"] >= 1 and t["stopped_by"] in ("time", "steps") and t["total_steps"] == t["steps"]
    h = report["evaluation"]["heldout"]
    assert 0 <= h["mtp_two_ahead_agreement"] <= 1 and h["rows"] > 0
    md = open_gguf(out).metadata
    assert md["general.architecture"] == "llama-mtp" and "mtp.0.attn_q_norm.weight" not in open_gguf(out).tensors
    assert md["distill.heldout.two_ahead_agreement"] == pytest.approx(h["mtp_two_ahead_agreement"], abs=1e-6)
    r = cli("inspect", out, "--target", files / "llama.gguf")
    assert r.exit_code == 0, r.stdout + r.stderr
    plain = run_text("-m", files / "llama.gguf")
    assert run_text("-m", files / "llama.gguf", "--mtp", out) == plain


def _opts(run_dir, **kw):
    base = dict(data=[], steps=8, windows=6, seq_len=64, batch=2, anchors=4, eval_anchors=8,
                eval_tokens=0, threads=1, resume=str(run_dir), checkpoint_seconds=0.0,
                progress=False, self_generate=2)
    base.update(kw)
    return base


def _weights(path):
    f = open_gguf(path)
    return {n: np.asarray(t.raw()).tobytes() for n, t in f.tensors.items()}


class Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("kind", ["dspark", "mtp"])
def test_resume_gives_the_weights_of_an_uninterrupted_run(files, tmp_path, kind):
    text = str(files / "text")
    quiet = lambda msg: None  # noqa: E731
    target = files / "qwen3.gguf"
    # uninterrupted
    whole = distill(target, tmp_path / "whole.gguf", DistillOptions(kind, **_opts(tmp_path / "run-whole", data=[text])),
                    report=quiet)
    # Ctrl-C after step 3: the loop saves that step and re-raises
    def stop_at_3(step):
        if step == 3:
            raise Interrupt()
    with pytest.raises(Interrupt):
        distill(target, tmp_path / "a.gguf", DistillOptions(kind, **_opts(tmp_path / "run-a", data=[text])),
                report=quiet, on_step=stop_at_3)
    assert not (tmp_path / "a.gguf").exists()
    a = distill(target, tmp_path / "a.gguf", DistillOptions(kind, **_opts(tmp_path / "run-a", data=[text])),
                report=quiet)
    assert a.report["training"]["resumed_from_step"] == 3
    # killed (no chance to save) after step 5: a copy of the run directory as it was then
    def snapshot_at_5(step):
        if step == 5:
            shutil.copytree(tmp_path / "run-b", tmp_path / "run-killed")
    distill(target, tmp_path / "b.gguf", DistillOptions(kind, **_opts(tmp_path / "run-b", data=[text])),
            report=quiet, on_step=snapshot_at_5)
    c = distill(target, tmp_path / "c.gguf", DistillOptions(kind, **_opts(tmp_path / "run-killed", data=[text])),
                report=quiet)
    assert c.report["training"]["resumed_from_step"] == 5
    want = _weights(whole.output)
    assert want == _weights(a.output) == _weights(c.output) == _weights(tmp_path / "b.gguf")
    ck = [torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["model"]
          for d in ("run-whole", "run-a", "run-killed")]
    for name, value in ck[0].items():
        assert torch.equal(value, ck[1][name]) and torch.equal(value, ck[2][name]), name
    # the same run directory with other options is refused, naming the option
    r = cli("distill", target, "--kind", kind, "-o", tmp_path / "d.gguf", "--data", text, "--steps", 9,
            "--windows", 6, "--seq-len", 64, "--batch", 2, "--anchors", 4, "--self-generate", 2,
            "--resume", tmp_path / "run-a")
    assert r.exit_code == 2 and "this run was started with steps = 8, now 9" in r.stderr, r.stderr
    assert not (tmp_path / "d.gguf").exists()


@pytest.mark.parametrize("kind,cfg_name", [("dspark", "qwen3"), ("dspark", "llama"), ("mtp", "qwen3"),
                                           ("mtp", "llama")])
def test_the_torch_drafts_compute_what_the_engine_runs(files, tmp_path, kind, cfg_name):
    """A draft is trained on the numbers it will see: the torch module and the engine's drafter
    loaded from the written file (F32, so storage adds no rounding) give the same logits from
    the same engine features (qwen3's rope halves and q/k norms, llama's adjacent pairs)."""
    import torch.nn.functional as F
    from ds4tools.distill import run as R
    from ds4tools.distill.evaluate import load_drafter
    from ds4tools.distill.export import write_draft
    from ds4tools.distill.features import target_features
    from ds4tools.distill.target import open_frozen_target
    from ds4tools.engine.speculative.mtp import MtpHead
    torch.manual_seed(1)
    t = open_frozen_target(files / f"{cfg_name}.gguf", threads=1)
    try:
        toks = np.asarray(t.tokenizer.encode(corpus_text(12, seed=9), add_special=False)[:90], np.int64)
        layers = [0, 1] if kind == "dspark" else None
        opts = DistillOptions(kind, data=["x"], steps=1)
        module, task = R._build(t, opts, None, layers, 4 if kind == "dspark" else 1, 7)
        R._init(module, t, opts)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        path = tmp_path / "d.gguf"
        write_draft(kind, module, t, str(path), R._draft_config(t, opts, layers, 4, 7), "F32", overwrite=True)
        feats, final = target_features(t, toks, layers or [])
        if kind == "mtp":
            with torch.no_grad():
                y = module(torch.from_numpy(final[None, :-1]), F.embedding(torch.from_numpy(toks[None, 1:]), task.embed),
                           task.rope)
                want = F.linear(y, task.lm_head)[0].numpy()
            head = MtpHead(t.engine.model, load_drafter(t, str(path), "mtp").mtp.w)
            got = head.head(head.run(final[:-1], toks[1:], 0))[1]
        else:
            a = 60
            with torch.no_grad():
                ids = torch.full((1, 4), 7)
                ids[0, 0] = int(toks[a])
                hid = module.blocks(torch.from_numpy(feats[None]), F.embedding(ids, task.embed),
                                    torch.tensor([[a]]), 4, task.rope)
                want = F.linear(hid, task.lm_head)[0, 0].numpy()
            drafter = load_drafter(t, str(path), "dspark")
            pre = t.engine.forward(toks[:a], 0, hidden_layers=drafter.hidden_layers, logits="none")
            drafter.start([int(x) for x in toks[:a]], pre)
            got = drafter._base_logits(drafter._block(int(toks[a])))
        scale = float(np.abs(got).max())
        assert np.abs(want - got).max() < 1e-4 * scale + 1e-5, np.abs(want - got).max()
        assert (want.argmax(-1) == got.argmax(-1)).all()
    finally:
        t.close()
