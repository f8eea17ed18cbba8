"""GGUF quantization and Hugging Face conversion, with llama.cpp's mixes and per-tensor rules.

    >>> from ds4tools.quantize import quantize_model, QuantizeOptions
    >>> quantize_model("hf-dir/", "model-q4_k_m.gguf", QuantizeOptions("Q4_K_M")).summary
"""
from .pipeline import QuantizeOptions, QuantizeResult, quantize_model
from .plan import Plan, PlanEntry, build_plan
from .source import ModelSource, SourceTensor, open_source

__all__ = ["quantize_model", "QuantizeOptions", "QuantizeResult", "build_plan", "Plan",
           "PlanEntry", "open_source", "ModelSource", "SourceTensor"]
