"""The vocabulary shared by the support layouts: what a tensor must be (``TensorSpec``), the type
kinds a role accepts (``Kind``), the problems found (``Problem``), and the checks that turn a
spec and a stored tensor into problems worded the way each program words them.

Every layout module (mtp, dspark_ds4, dspark_llamacpp) lists its tensors as specs computed from
hyper-parameters; the writer, the validator and the engine's loader all read those lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from gguf import GGMLQuantizationType

__all__ = ["Kind", "TensorSpec", "Problem", "Problems", "F32", "PLAIN", "DENSE_DS4",
           "Q8_0_ONLY", "ROUTED_DS4", "ROUTED_MTP", "ANY_WEIGHT", "MessageStyle", "DS4_MTP",
           "DS4_DSPARK", "LLAMA_CPP", "check_tensor", "type_name", "llama_shape"]


@dataclass(frozen=True)
class Kind:
    """The stored types a tensor role accepts, and how a message names them."""
    label: str
    types: frozenset | None  # None: any float or quantized type ds4tools can decode
    routed: bool = False  # ds4 words a wrong routed-expert type differently

    def accepts(self, t: str) -> bool:
        if self.types is None:
            from .. import formats
            return t in formats.FORMATS
        return t in self.types


F32 = Kind("F32", frozenset({"F32"}))
PLAIN = Kind("F16 or F32", frozenset({"F16", "F32"}))
Q8_0_ONLY = Kind("Q8_0", frozenset({"Q8_0"}))
#: ds4's DSpark "dense" kind
DENSE_DS4 = Kind("F16, F32, or Q8_0", frozenset({"F16", "F32", "Q8_0"}))
#: ds4's routed-expert types: the DSpark validator's list, and the MTP one of ds4 @8d57664
ROUTED_DS4 = Kind("routed expert quant", frozenset({"Q8_0", "IQ2_XXS", "Q2_K", "Q4_K", "MXFP4"}),
                  routed=True)
ROUTED_MTP = Kind("routed expert quant", frozenset({"IQ2_XXS", "Q2_K", "Q4_K"}), routed=True)
#: our dense MTP layout: any matrix type the engine decodes
ANY_WEIGHT = Kind("a float or quantized weight type", None)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    role: str  # the short role ds4 prints ("attn_q_a", "main_proj"...)
    kind: Kind
    shape: tuple  # ggml order (ne0 first); None entries are not known and not checked
    required: bool = True
    #: what the writer stores by default for this role ("F32", "F16", "Q8_0", "Q4_K" or None
    #: for "the requested type")
    default_type: str | None = None


@dataclass(frozen=True)
class Problem:
    level: str  # "error" or "warning"
    message: str
    #: the one program the problem stops ("llama.cpp"), when others run the file anyway
    #: (ds4tools' engine runs a draft that reads the target's last layer; llama.cpp cannot)
    only: str | None = None

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


@dataclass
class Problems:
    items: list[Problem] = field(default_factory=list)

    def error(self, msg: str, only: str | None = None) -> None:
        self.items.append(Problem("error", msg, only))

    def warning(self, msg: str) -> None:
        self.items.append(Problem("warning", msg))

    def extend(self, other: Iterable[Problem]) -> None:
        self.items.extend(other)

    @property
    def errors(self) -> list[str]:
        return [p.message for p in self.items if p.level == "error"]

    def errors_for(self, runtime: str | None) -> list[str]:
        """The errors that stop ``runtime`` (None: every error): a problem that stops only
        another program is left out."""
        return [p.message for p in self.items
                if p.level == "error" and (runtime is None or p.only in (None, runtime))]

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return str(ggml_type)


def llama_shape(dims) -> str:
    """llama.cpp's llama_format_tensor_shape: each dimension right-aligned in 5 columns."""
    return ", ".join(f"{d:>5}" if isinstance(d, str) else f"{int(d):5d}" for d in dims)


@dataclass(frozen=True)
class MessageStyle:
    """How one program words a missing tensor, a wrong type, a wrong rank, a wrong dimension."""
    missing: Callable[[TensorSpec], str]
    wrong_type: Callable[[TensorSpec, object], str]
    wrong_ndim: Callable[[TensorSpec, object], str] | None
    wrong_dim: Callable[[TensorSpec, object, int], str] | None
    #: one message for the whole shape (llama.cpp) instead of per-dimension ones
    wrong_shape: Callable[[TensorSpec, object], str] | None = None


def _ds4_type(spec: TensorSpec, t) -> str:
    if spec.kind.routed:
        return (f"tensor {spec.name} has type {t.ggml_type} ({t.type_name}), expected a routed "
                f"expert quant type")
    return f"tensor {spec.name} has type {t.type_name}, expected {spec.kind.label}"


#: ds4's main-model / MTP validator (tensor_expect_layout and friends)
DS4_MTP = MessageStyle(
    missing=lambda s: f"required tensor is missing: {s.name}",
    wrong_type=_ds4_type,
    wrong_ndim=lambda s, t: f"tensor {s.name} has {len(t.ggml_shape)} dimensions, expected {len(s.shape)}",
    wrong_dim=lambda s, t, i: f"tensor {s.name} has dim[{i}]={t.ggml_shape[i]}, expected {s.shape[i]}",
)

#: ds4's DSpark validator (dspark_validate_tensor_layout)
DS4_DSPARK = MessageStyle(
    missing=lambda s: f"DSpark tensor {s.name} ({s.role}) is missing",
    wrong_type=lambda s, t: (f"DSpark tensor {s.name} ({s.role}) has type {t.type_name}, "
                             f"expected {s.kind.label}"),
    wrong_ndim=lambda s, t: (f"DSpark tensor {s.name} ({s.role}) has {len(t.ggml_shape)} dimensions, "
                             f"expected {len(s.shape)}"),
    wrong_dim=lambda s, t, i: (f"DSpark tensor {s.name} ({s.role}) has dim[{i}]={t.ggml_shape[i]}, "
                               f"expected {s.shape[i]}"),
)

#: llama.cpp's model loader (llama_model_loader::check_tensor_dims)
LLAMA_CPP = MessageStyle(
    missing=lambda s: f"tensor '{s.name}' not found",
    wrong_type=lambda s, t: f"tensor '{s.name}' has type {t.type_name}, which ds4tools cannot decode",
    wrong_ndim=None,
    wrong_dim=None,
    wrong_shape=lambda s, t: (f"tensor '{s.name}' has wrong shape; expected "
                              f"{llama_shape('?' if d is None else d for d in s.shape)}, got "
                              f"{llama_shape(tuple(t.ggml_shape) + (1,) * (4 - len(t.ggml_shape)))}"),
)


def check_tensor(spec: TensorSpec, t, style: MessageStyle) -> list[str]:
    """The problems of stored tensor ``t`` (a TensorRef or None) against ``spec``."""
    if t is None:
        return [style.missing(spec)] if spec.required else []
    out = []
    if not spec.kind.accepts(t.type_name):
        out.append(style.wrong_type(spec, t))
    got = tuple(int(d) for d in t.ggml_shape)
    if style.wrong_shape is not None:  # llama.cpp compares all four ggml dims (missing ones are 1)
        want4 = tuple(spec.shape) + (1,) * (4 - len(spec.shape))
        got4 = got + (1,) * (4 - len(got))
        if any(w is not None and w != g for w, g in zip(want4, got4)):
            out.append(style.wrong_shape(spec, t))
        return out
    if len(got) != len(spec.shape):
        out.append(style.wrong_ndim(spec, t))
    for i in range(min(len(got), len(spec.shape))):
        if spec.shape[i] is not None and got[i] != spec.shape[i]:
            out.append(style.wrong_dim(spec, t, i))
    return out
