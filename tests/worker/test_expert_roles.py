"""The role table the fused kernels read, from a layer's layout: gate/up/down (or a fused gate_up
split in two), float32 biases; anything else is refused by name when the model loads."""

from __future__ import annotations

import pytest

from expertpack.packtools.layout import LayerLayout, RoleLayout
from expertpack.worker.weights.expert_roles import UnsupportedExperts, expert_roles


def layer(*roles: tuple[str, str, tuple[int, ...]]) -> LayerLayout:
    out, offset = [], 0
    for role, ggml_type, shape in roles:
        out.append(RoleLayout(role, f"blk.3.ffn_{role}", ggml_type, shape, offset, 4096))
        offset += 4096
    return LayerLayout(3, 0, offset, offset, tuple(out))


def test_fused_gate_up_is_read_as_two_matrices() -> None:
    roles = expert_roles(layer(("gate_up", "Q8_0", (256, 2 * 64)), ("down", "Q4_K", (64, 256)),
                               ("gate_up.bias", "F32", (128,))))
    assert (roles.gate.n, roles.up.n, roles.gate.k) == (64, 64, 256)
    assert roles.up.offset == roles.gate.offset + 64 * roles.gate.row_bytes == 64 * 8 * 34
    assert roles.up_bias == roles.gate_bias + 4 * 64


@pytest.mark.parametrize("roles,needle", [
    ((("gate", "Q4_K", (256, 64)), ("up", "Q4_K", (256, 64)), ("down", "Q4_K", (64, 256)),
      ("down.scale", "F32", (256,))), "down.scale"),
    ((("gate", "Q4_K", (256, 64)), ("down", "Q4_K", (64, 256))), "need gate and up"),
    ((("gate", "Q4_K", (256, 64)), ("up", "Q4_K", (256, 64)), ("down", "Q4_K", (32, 256))), "do not chain"),
    ((("gate", "MXFP4", (256, 64)), ("up", "MXFP4", (256, 64)), ("down", "MXFP4", (64, 256)),
      ("gate.bias", "F16", (64,)), ("up.bias", "F16", (64,))), "float32"),
    ((("gate", "Q4_K", (256, 64)), ("up", "Q4_K", (256, 64)), ("down", "Q4_K", (64, 256)),
      ("gate.bias", "F32", (64,))), "only one of gate and up"),
    ((("gate", "NVFP4", (256, 64)), ("up", "NVFP4", (256, 64)), ("down", "Q4_K", (64, 256))),
     "blk.3.ffn_gate is NVFP4; blk.3.ffn_up is NVFP4, a type this worker does not decode"),
])
def test_what_the_kernels_cannot_run_is_refused_by_name(roles, needle: str) -> None:
    with pytest.raises(UnsupportedExperts, match=needle) as refused:
        expert_roles(layer(*roles))
    assert "layer 3" in str(refused.value)
