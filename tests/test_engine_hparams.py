"""Hyper-parameters from GGUF metadata: llama.cpp's keys, defaults, and one-line errors."""
import pytest

from ds4tools.engine.hparams import HParamsError, hparams_from_metadata
from tests.reference_model import RefConfig, config_metadata

CFG = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, n_ff=96)


def meta(**change):
    m = {"general.architecture": "qwen3", **config_metadata(CFG)}
    for k, v in change.items():
        key = "qwen3." + k.replace("__", ".")
        if v is None:
            m.pop(key, None)
        else:
            m[key] = v
    return m


def test_reads_llama_cpp_keys():
    hp = hparams_from_metadata(meta())
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == (64, 2, 4, 2, 32, 96)
    assert hp.n_q == 128 and hp.n_kv == 64 and hp.rope_type == "neox" and hp.rope_scaling == "none"
    assert hp.yarn is None


def test_defaults_as_llama_cpp():
    hp = hparams_from_metadata(meta(attention__head_count_kv=None, attention__key_length=None,
                                    attention__value_length=None, rope__dimension_count=None,
                                    rope__freq_base=None))
    assert hp.n_head_kv == 4 and hp.head_dim == 16 and hp.n_rot == 16 and hp.rope_freq_base == 10000.0


def test_llama_rope_is_adjacent_pairs():
    m = {k.replace("qwen3", "llama"): v for k, v in meta().items()} | {"general.architecture": "llama"}
    assert hparams_from_metadata(m).rope_type == "norm"


def test_yarn_scaling():
    hp = hparams_from_metadata(meta(rope__scaling__type="yarn", rope__scaling__factor=4.0,
                                    rope__scaling__original_context_length=128,
                                    rope__scaling__yarn_beta_fast=16.0))
    assert hp.rope_freq_scale == 0.25 and hp.yarn == (128, 16.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("change, message", [
    (dict(block_count=None), "missing metadata key qwen3.block_count"),
    (dict(embedding_length="64"), "metadata key qwen3.embedding_length must be an integer, got str"),
    (dict(attention__head_count=0), "metadata key qwen3.attention.head_count must be positive, got 0"),
    (dict(attention__head_count_kv=3), "qwen3.attention.head_count (4) is not a multiple of qwen3.attention.head_count_kv (3)"),
    (dict(rope__dimension_count=33), "qwen3.rope.dimension_count must be even and in [2, 32], got 33"),
    (dict(rope__scaling__type="longrope"), "unsupported qwen3.rope.scaling.type 'longrope'"),
    (dict(attention__layer_norm_rms_epsilon=float("nan")), "must be finite"),
    (dict(attention__value_length=16), "qwen3.attention.value_length (16) differs from"),
])
def test_bad_metadata(change, message):
    with pytest.raises(HParamsError) as e:
        hparams_from_metadata(meta(**change))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_architecture():
    with pytest.raises(HParamsError, match="unsupported architecture 'gemma3'"):
        hparams_from_metadata({"general.architecture": "gemma3"})
