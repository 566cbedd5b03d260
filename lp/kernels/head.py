"""The LM head's greedy screen: a bf16 pass that proves which tokens can be a row's argmax,
and the fp32 logits of those alone (``model.head=auto``).

Contract: ``screen_head(model, mode)`` gives the model's packed fp32 output embedding
(lp.kernels.linears.pack) a ``HeadScreen`` when ``mode`` is ``screen``, or ``auto`` and a
bf16 head measured faster here; it returns the screen or None. While
``linears.ARGMAX_ONLY.on`` (lp.model.runner, for a step whose every kept row feeds only a
greedy argmax: no sampling, processors, grammar or logprobs), the head returns, per row,
an fp32 logit (up to fp32 rounding) of every token that can be the row's maximum and -inf
elsewhere, and only when it has proved each row's argmax: then that argmax is, token for
token, the argmax of the fp32 head (of any float32 evaluation of it: the packed head the step
would run otherwise, ``x @ W.T``, whatever the summation order), and no such evaluation can
tie it with another token. Nothing else in it is a logit. ``logits`` returns None (the caller
runs the fp32 head, whose argmax, ties by the first index, then decides) for more than
``MAX_ROWS`` rows, a screen that kept too many tokens, a row that is not finite, a row whose
two best kept logits are within two fp32 rounding bounds of each other (a near tie, or a tie,
that another summation order could decide the other way), or a float32 matmul precision other
than ``highest`` (where torch may compute "fp32" products in bf16 or tf32).

Why: the fp32 head is the largest weight a step reads (SmolLM2: 49,152 x 576, 113 MB;
1.7-2.2 ms of a ~19 ms one-row compiled step on this project's 2-core EPYC, AVX-512 BF16,
oneDNN packed), its bf16 copy half the bytes (0.85 ms at 1 row, 1.2 ms at 8), and a greedy
step needs one token a row, not 49,152 logits.

The proof. x a row's hidden state (fp32, D wide), w_v token v's weight row, u = 2^-8 the
bf16 unit roundoff (8 significant bits: 1 + 2^-8 - 2^-20 rounds to 1), f_v the fp32 head's
logit (any float32 evaluation: within D 2^-24 sum_i |x_i||w_vi| of x . w_v). bf16 rounds x and
w_v to within u of each element, their products are exact in fp32 and summed in fp32, so the
screened s_v = fl(x~ . w~_v) before its own output rounding differs from f_v by at most
(2u + u^2 + 2 D 2^-24) sum_i |x_i||w_vi|, which is at most ``bound`` ||x|| ||w_v||
(Cauchy-Schwarz; the 2 D 2^-24 term is the two fp32 summations, the screen's and the fp32
head's own, with 1% slack); the bf16 output y_v rounds s_v to within u |y_v|. So with
e_v = bound ||x|| ||w_v|| + u |y_v|, every f_v lies in [y_v - e_v, y_v + e_v]. Let t be the
screen's top token: max_v f_v >= f_t >= y_t - e_t, so a token v can be (or tie) the maximum
only if y_v + e_v >= y_t - e_t. The screen keeps exactly those (it uses the largest ||w_v||
for every v: one threshold a row); every other token's f_v is below the maximum. Then it
computes the kept tokens' fp32 logits z_v from x and w_v: another float32 evaluation, so
|z_v - f_v| <= 2 D 2^-24 (1.01) ||x|| ||w_v|| =: d (``fp32_bound``). If a row's best z_a
exceeds every other z_b by more than 2 d, then f_a > f_b for every kept b: a is the fp32 head's
argmax, strictly (no tie). Else the step goes to the fp32 head. ``test_head`` builds a row whose
bf16 rounding errs by ~2 u sum |x||w| towards a wrong token: a bound of half this one (the
unit roundoff taken as 2^-9, as this screen did before) drops the true argmax there.
Measured on SmolLM2 chat rows here (329 greedy rows of 12 mt_bench / gsm8k prompts): the bound
~2.7 logits a side (median), 1-322 tokens kept a row (median 8); 2 d ~0.05 logits, and 7 of
the 329 rows are that close to a tie (they send their step to the fp32 head: 7 of 42 steps of
8 such rows). (Measured before with u = 2^-9: ~1.3 logits, 1-66 kept.)

The kept tokens' fp32 logits come from one [M, D] x [D, U] product over their fp32 weight
rows (U the kept tokens of all rows: a row gets values for other rows' tokens too). The
screen reads block maxima (``amax`` over blocks of 64 tokens: vectorized, where torch's
argmax and max-with-index run ~15x slower on this CPU), then only the blocks that reach the
threshold. ``argmax_rows`` reads any step's argmax the same way (the fp32 head's too).

Legend: M rows, D hidden, V vocabulary, P kept (row, token) pairs.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from lp.kernels import linears

HEADS = ("auto", "screen", "exact")
# more rows: the fp32 head. Measured here on SmolLM2 chat rows, head + argmax, fp32 / screen:
# 1 row 2.6 / 1.8 ms, 8 rows 3.7 / 1.9, 24 rows 5.9 / 4.1, 32 rows 6.9 / 5.7, 48 rows 10.1 / 13.8
MAX_ROWS = 32
MAX_PAIRS_PER_ROW = 512  # a flatter screen: the fp32 head (random-token rows keep ~300 a row)


class HeadScreen:
    def __init__(self, weight_VD: torch.Tensor):
        self.weight_VD = weight_VD  # the head's own fp32 weight (shared, not copied; screen_head: fp32 only)
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight_VD.to(torch.bfloat16), None)
        u, d = 2.0 ** -8, weight_VD.shape[1]  # bf16: 8 significant bits, round to nearest
        bound = 1.01 * (2 * u + u * u + 2 * d * 2.0 ** -24)
        w_max = torch.linalg.vector_norm(weight_VD, dim=1).max().item()
        self.bound = bound * w_max
        self.fp32_bound = 1.01 * 2 * d * 2.0 ** -24 * w_max  # two float32 evaluations of one logit differ by less
        self.undecided = 0  # forwards left to the fp32 head for a row the fp32 rounding could decide either way
        self.block = _block(weight_VD.shape[0])  # the screen reads block maxima first
        self.calls = 0  # forwards the screen answered (tests read it)

    def __reduce__(self):
        # an opaque oneDNN tensor cannot be copied or pickled: a copied model screens again (screen_head)
        return (type(None), ())

    def bf16_logits(self, x_MD: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x_MD.to(torch.bfloat16), self.packed_bf16, None, "none", [], "")

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        x_MD = x.reshape(-1, x.shape[-1])
        m, v = x_MD.shape[0], self.weight_VD.shape[0]
        if m > MAX_ROWS or self.block is None or torch.get_float32_matmul_precision() != "highest":
            return None
        y_MV = self.bf16_logits(x_MD).float()
        y_MNB = y_MV.view(m, -1, self.block)
        blocks_MN = y_MNB.amax(-1)  # amax: vectorized (max with an index is ~15x slower here)
        top_M = blocks_MN.amax(-1)
        xn_M = torch.linalg.vector_norm(x_MD, dim=-1)
        a_M = self.bound * xn_M
        # L: the fp32 maximum is at least the top's lower bound; v can reach it only if
        # g(y_v) + A >= L, g(y) = y + 2^-8 |y| increasing, so y_v >= g^-1(L - A)
        z_M = top_M - 2.0 ** -8 * top_M.abs() - 2 * a_M
        floor_M = torch.where(z_M >= 0, z_M / (1 + 2.0 ** -8), z_M / (1 - 2.0 ** -8))
        if not bool(torch.isfinite(floor_M).all()):  # inf or nan in a row: the fp32 head decides
            return None
        m_S, n_S = (blocks_MN >= floor_M[:, None]).nonzero(as_tuple=True)  # the few blocks reaching it
        s_P, j_P = (y_MNB[m_S, n_S] >= floor_M[m_S, None]).nonzero(as_tuple=True)
        if s_P.numel() > MAX_PAIRS_PER_ROW * m:
            return None
        # every kept token's fp32 logit in every row (a token kept for one row only is still a logit
        # in the others): one [M, D] x [D, U] product over the kept tokens' fp32 weight rows
        v_U = torch.unique(n_S[s_P] * self.block + j_P)
        z_MU = x_MD @ self.weight_VD[v_U].t()
        if v_U.numel() > 1:  # each row's best must beat its runner-up by more than two fp32 rounding bounds
            top2_M2 = z_MU.topk(2, dim=-1).values
            gap_M = top2_M2[:, 0] - top2_M2[:, 1]
            if not bool((gap_M > 2 * self.fp32_bound * xn_M).all()):
                self.undecided += 1
                return None
        out_MV = torch.full((m, v), float("-inf"), dtype=torch.float32, device=y_MV.device)
        out_MV[:, v_U] = z_MU
        self.calls += 1
        return out_MV.reshape(*x.shape[:-1], v)


def argmax_rows(logits_KV: torch.Tensor) -> list[int]:
    """``logits_KV.argmax(-1).tolist()`` (the first maximum of each row), read through block
    maxima: torch's argmax runs ~15x slower than its amax on this CPU (8 x 49,152: 0.23 ms
    against 0.014). Rows holding nan, or a vocabulary no block size divides, take torch's."""
    k, v = logits_KV.shape
    block = _block(v)
    if block is None or k == 0:
        return logits_KV.argmax(-1).tolist()
    y_KNB = logits_KV.reshape(k, -1, block)
    blocks_KN = y_KNB.amax(-1)
    top_K = blocks_KN.amax(-1, keepdim=True)
    if not bool(torch.isfinite(top_K).all()):
        return logits_KV.argmax(-1).tolist()
    first_K = (blocks_KN == top_K).int().argmax(-1)  # the first block holding the maximum
    rows_K = torch.arange(k, device=logits_KV.device)
    within_K = (y_KNB[rows_K, first_K] == top_K).int().argmax(-1)
    return (first_K * block + within_K).tolist()


def _block(v: int) -> int | None:
    return next((b for b in (64, 32, 16) if v % b == 0), None)


def screen_head(model: nn.Module, mode: str) -> HeadScreen | None:
    """``model.head``: the screen of the model's packed head (``linears.pack`` first), kept on the
    model; ``auto`` only where the bf16 head measures at most 3/4 of the fp32 one (2 rows, the
    compiled one-row step's shape). ``mode`` is one of ``HEADS`` (lp.model.runner checks it)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (mode == "exact" or not isinstance(head, linears.SmallRowsLinear) or head.packed_key < 0
            or head.weight.dtype != torch.float32):
        return None
    screen = getattr(model, "_lp_head_screen", None)
    if screen is None:
        if not linears.bf16_packs():
            if mode == "screen":
                raise ValueError("model.head=screen needs oneDNN's bf16 linears, which this CPU lacks (AVX-512 BW / "
                                 "VL / DQ or AVX-NE-CONVERT): use model.head=auto or exact")
            return None
        screen = HeadScreen(head.weight.detach())
        with torch.inference_mode():
            x_2D = torch.randn(2, head.in_features)
            fp32 = _fastest(lambda: linears._packed(x_2D, head.packed_key))
            bf16 = _fastest(lambda: screen.bf16_logits(x_2D))
        screen.measured = (fp32, bf16)
        model._lp_head_screen = screen
    if mode == "auto" and screen.measured[1] > 0.75 * screen.measured[0]:
        return None
    key = head.packed_key
    linears.SCREENS[key] = weakref.ref(screen, lambda _, key=key: linears.SCREENS.pop(key, None))
    return screen


def _fastest(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
