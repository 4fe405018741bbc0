"""The Mamba2 mixer of a hybrid decoder, step by step over a request's recurrent state.

Per request: causal depthwise conv (state: the last ``K - 1`` inputs), then the selective scan
``h = h * exp(dt * A) + dt * B x``, ``y = C h + D x`` token by token in float32, then the gated
grouped RMSNorm and the output projection. Matches transformers' torch path of Bamba.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional

from kvplane.models.bamba_config import BambaConfig, MambaShape
from kvplane.models.layers import Linear
from kvplane.models.weights import TensorSource, WeightKind


@dataclass(frozen=True, slots=True)
class MambaMixer:
    """One Mamba2 layer's weights (HF names under ``model.layers.{i}.mamba``)."""

    shape: MambaShape
    in_proj: Linear
    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor  # [H]
    a_log: torch.Tensor  # [H]
    d: torch.Tensor  # [H]
    norm_weight: torch.Tensor  # [inner]
    out_proj: Linear
    eps: float
    dt_limit: tuple[float, float]

    @classmethod
    def load(cls, src: TensorSource, cfg: BambaConfig, i: int) -> MambaMixer:
        p, s, hid = f"model.layers.{i}.mamba", cfg.mamba, cfg.hidden_size
        proj = s.inner + s.conv_dim + s.num_heads
        conv = src.take(f"{p}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel), WeightKind.MATRIX)
        bias = (
            src.take(f"{p}.conv1d.bias", (s.conv_dim,), WeightKind.BIAS) if cfg.conv_bias else None
        )
        return cls(
            shape=s,
            in_proj=Linear.load(src, f"{p}.in_proj", proj, hid, cfg.proj_bias),
            conv_weight=conv[:, 0],
            conv_bias=bias,
            dt_bias=src.take(f"{p}.dt_bias", (s.num_heads,), WeightKind.MATRIX),
            a_log=src.take(f"{p}.A_log", (s.num_heads,), WeightKind.MATRIX),
            d=src.take(f"{p}.D", (s.num_heads,), WeightKind.MATRIX),
            norm_weight=src.take(f"{p}.norm.weight", (s.inner,), WeightKind.NORM),
            out_proj=Linear.load(src, f"{p}.out_proj", hid, s.inner, cfg.proj_bias),
            eps=cfg.rms_norm_eps,
            dt_limit=cfg.time_step_limit,
        )

    def __call__(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm: torch.Tensor
    ) -> torch.Tensor:
        """``x [n, hidden]``: one request's next ``n`` tokens; advances ``conv_state
        [conv_dim, K - 1]`` and ``ssm [H, P, N]`` (float32, in place) past them and returns
        ``[n, hidden]`` in x's dtype."""
        s, n = self.shape, x.shape[0]
        gate, xbc, dt = torch.split(self.in_proj(x), [s.inner, s.conv_dim, s.num_heads], dim=-1)
        seq = torch.cat([conv_state.to(x.dtype), xbc.transpose(0, 1)], dim=-1)
        conv_state.copy_(seq[:, seq.shape[1] - conv_state.shape[1] :])
        conv = functional.conv1d(
            seq[None], self.conv_weight[:, None], self.conv_bias, groups=s.conv_dim
        )
        xbc = functional.silu(conv[0].transpose(0, 1))  # [n, conv_dim]
        gn = s.num_groups * s.state_size
        xs, b, c = torch.split(xbc.float(), [s.inner, gn, gn], dim=-1)
        rep = s.num_heads // s.num_groups
        b = b.view(n, s.num_groups, s.state_size).repeat_interleave(rep, dim=1)  # [n, H, N]
        c = c.view(n, s.num_groups, s.state_size).repeat_interleave(rep, dim=1)
        xs = xs.view(n, s.num_heads, s.head_dim)
        dt = functional.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        decay = torch.exp(dt * -torch.exp(self.a_log.float()))  # [n, H]
        ys = []
        h = ssm
        for t in range(n):
            h = (
                h * decay[t, :, None, None]
                + (dt[t, :, None, None] * xs[t, :, :, None]) * b[t, :, None, :]
            )
            ys.append(torch.einsum("hpn,hn->hp", h, c[t]))
        ssm.copy_(h)
        y = torch.stack(ys) + self.d.float()[:, None] * xs  # [n, H, P]
        y = y.reshape(n, s.inner) * functional.silu(gate.float())
        groups = y.view(n, s.num_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm_weight * groups.view(n, s.inner).to(x.dtype)
        return self.out_proj(out)
