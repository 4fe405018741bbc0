"""The Triton kernel of the ``triton`` backend: absorbed MLA over a paged latent cache.

Imported only by :mod:`kvplane.attention.backends.triton_mla`, after its checks. Triton is
imported at the top and there is no ``from __future__ import annotations``: Triton needs
module-level kernels and real ``tl.constexpr`` annotations. See docs/attention.md.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def mla_paged_decode_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    q_nope_ptr,
    q_pe_ptr,
    cache_ptr,
    block_table_ptr,
    tok_req_ptr,
    tok_limit_ptr,
    out_ptr,
    lse_ptr,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_c_page,
    stride_c_tok,
    stride_bt,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    num_heads,
    sm_scale,
    page_size: tl.constexpr,
    rank: tl.constexpr,
    rope: tl.constexpr,
    block_h: tl.constexpr,
    block_n: tl.constexpr,
):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * block_h + tl.arange(0, block_h)
    hmask = heads < num_heads
    req = tl.load(tok_req_ptr + tok).to(tl.int64)
    limit = tl.load(tok_limit_ptr + tok)
    dr = tl.arange(0, rank)
    dp = tl.arange(0, rope)
    qn = tl.load(
        q_nope_ptr + tok * stride_qn_t + heads[:, None] * stride_qn_h + dr[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    qp = tl.load(
        q_pe_ptr + tok * stride_qp_t + heads[:, None] * stride_qp_h + dp[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    m = tl.full([block_h], float("-inf"), tl.float32)
    denom = tl.zeros([block_h], tl.float32)
    acc = tl.zeros([block_h, rank], tl.float32)
    for start in range(0, limit, block_n):
        pos = start + tl.arange(0, block_n)
        pmask = pos < limit
        page = tl.load(block_table_ptr + req * stride_bt + pos // page_size, mask=pmask, other=0)
        row = page.to(tl.int64) * stride_c_page + (pos % page_size) * stride_c_tok
        ckv = tl.load(cache_ptr + row[:, None] + dr[None, :], mask=pmask[:, None], other=0.0)
        kpe = tl.load(cache_ptr + rank + row[:, None] + dp[None, :], mask=pmask[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(ckv)) + tl.dot(qp, tl.trans(kpe))
        s = tl.where(pmask[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(ckv.dtype), ckv)
        m = m_new
    seen = denom > 0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
    tl.store(
        out_ptr + tok * stride_o_t + heads[:, None] * stride_o_h + dr[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )
    tl.store(lse_ptr + tok * stride_l_t + heads, lse, mask=hmask)
