"""What a gated MLP computes between its two halves, as data: the torch formula here (the CPU path
and the reference) and the Triton epilogue in kernels/moe_tl.py implement the same `Activation`, so
an architecture names its activation instead of passing code around."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F


class ActKind(IntEnum):
    SWIGLU = 0  # silu(gate) * up; with a finite limit, gate <= limit and |up| <= limit first (DeepSeek-V4)
    SWIGLU_OAI = 1  # gpt-oss: gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)
    SITU = 2  # Kimi-K3: beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta), or up)


@dataclass(frozen=True)
class Activation:
    kind: ActKind = ActKind.SWIGLU
    limit: float = math.inf
    alpha: float = 1.0
    beta: float = 1.0
    linear_beta: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind is ActKind.SWIGLU:
            if self.limit == math.inf:
                return F.silu(gate) * up
            return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        if self.kind is ActKind.SWIGLU_OAI:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        a = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        return a * (self.linear_beta * torch.tanh(up / self.linear_beta) if self.linear_beta > 0 else up)


SWIGLU = Activation()
