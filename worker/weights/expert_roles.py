"""A layer's expert block as the fused kernels read it, built once from its role table (the pack's
manifest, or the same layout planned for a GGUF): which matrix is gate, up and down, their ggml
types, shapes and byte offsets, and the bias vectors. Torch- and Triton-free, so the CPU path can
check a model at load."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from expertpack.packtools.layout import LayerLayout, RoleLayout
from expertpack.packtools.quants import DECODED, nbytes_of


MATRICES = ("gate", "up", "gate_up", "down")  # the roles that are matrices (the others: biases)


class UnsupportedExperts(ValueError):
    """The layer's experts have roles the fused kernels do not implement."""


@dataclass(frozen=True)
class MatrixRole:
    """One expert matrix inside a block: ggml type id, ggml shape [K, N], byte offset in the block."""
    ggml_type: int
    k: int
    n: int
    offset: int

    @property
    def row_bytes(self) -> int:
        return nbytes_of(GGMLQuantizationType(self.ggml_type), (self.k,))


@dataclass(frozen=True)
class ExpertRoles:
    """A fused gate_up is read as a gate matrix with up's rows right after it."""
    gate: MatrixRole
    up: MatrixRole
    down: MatrixRole
    gate_bias: int | None = None  # byte offsets in the block of float32 bias vectors, where present
    up_bias: int | None = None
    down_bias: int | None = None


def expert_roles(layout: LayerLayout) -> ExpertRoles:
    roles = {r.role: r for r in layout.roles}
    known = {"gate", "up", "gate_up", "down", "gate.bias", "up.bias", "gate_up.bias", "down.bias"}
    where = f"layer {layout.layer}"
    if set(roles) - known:
        raise UnsupportedExperts(f"{where}: expert roles {sorted(set(roles) - known)} have no fused kernel")
    if "down" not in roles or not ("gate_up" in roles or {"gate", "up"} <= set(roles)):
        raise UnsupportedExperts(f"{where}: experts need gate and up (or gate_up) and down; found {sorted(roles)}")
    undecoded = sorted(f"{r.tensor} is {r.ggml_type}" for name, r in roles.items()
                       if name in MATRICES and GGMLQuantizationType[r.ggml_type] not in DECODED)
    if undecoded:
        raise UnsupportedExperts(f"{where}: {'; '.join(undecoded)}, a type this worker does not decode")
    down = _matrix(roles["down"])
    if "gate_up" in roles:
        fused = _matrix(roles["gate_up"])
        half = fused.n // 2
        gate = MatrixRole(fused.ggml_type, fused.k, half, fused.offset)
        up = MatrixRole(fused.ggml_type, fused.k, half, fused.offset + half * gate.row_bytes)
        bias = _bias(roles.get("gate_up.bias"), 2 * half, where)
        gate_bias, up_bias = (None, None) if bias is None else (bias, bias + 4 * half)
    else:
        gate, up = _matrix(roles["gate"]), _matrix(roles["up"])
        gate_bias, up_bias = _bias(roles.get("gate.bias"), gate.n, where), _bias(roles.get("up.bias"), up.n, where)
    if (gate_bias is None) != (up_bias is None):
        raise UnsupportedExperts(f"{where}: a bias on only one of gate and up")
    if gate.k != up.k or gate.n != up.n or down.k != gate.n:
        raise UnsupportedExperts(f"{where}: gate {gate.k}x{gate.n}, up {up.k}x{up.n}, down {down.k}x{down.n} "
                                 f"do not chain")
    return ExpertRoles(gate, up, down, gate_bias, up_bias, _bias(roles.get("down.bias"), down.n, where))


def _matrix(r: RoleLayout) -> MatrixRole:
    if len(r.shape) != 2:
        raise UnsupportedExperts(f"{r.tensor}: an expert matrix of shape {list(r.shape)}")
    return MatrixRole(int(GGMLQuantizationType[r.ggml_type]), r.shape[0], r.shape[1], r.offset)


def _bias(r: RoleLayout | None, n: int, where: str) -> int | None:
    if r is None:
        return None
    if r.ggml_type != "F32" or tuple(r.shape) != (n,):
        raise UnsupportedExperts(f"{where}: bias {r.tensor} is {r.ggml_type} {list(r.shape)}; the kernels read "
                                 f"float32 [{n}]")
    return r.offset
