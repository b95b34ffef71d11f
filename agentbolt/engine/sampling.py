"""Per-sequence sampling over one batched logits tensor.

Every row of a decode step may carry its own temperature, top-p, top-k and seed. The reported
log-probabilities are always those of the *raw* model distribution (``log_softmax`` of the logits,
before temperature or truncation): that is what a teacher-forced training pass recomputes, so the
two agree. vLLM reports the same by default (``logprobs_mode="raw_logprobs"``); OpenAI does not say.

Departure from the usual ``torch.multinomial`` per batch: each sampled row draws its uniform number
from its own ``torch.Generator``, so a seeded request gives the same tokens whatever else shares
its batch (inverse-CDF sampling over the row's truncated distribution).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from agentbolt.engine import kernels

__all__ = ["SamplingParams", "StepOutput", "first_argmax", "sample_step"]


@dataclass
class SamplingParams:
    """How one sequence picks its tokens and when it stops."""

    max_tokens: int = 16
    """Most tokens to generate (the engine also stops at the model's context length)."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps all."""
    seed: int | None = None
    """Seed of this sequence's own generator; None draws a fresh one."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the text (excluded from the returned text, like OpenAI)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the sequence in addition to the model's end-of-sequence tokens."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks)."""
    include_stop_str_in_output: bool = False
    """vLLM's flag: keep the matched stop string in the text."""
    top_logprobs: int = 0
    """How many alternatives to report per position (0: none)."""
    logprobs: bool = False
    """Whether the caller asked for log-probabilities (they are always computed)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def make_generator(self) -> torch.Generator:
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**63)
        return torch.Generator().manual_seed(seed)


@dataclass
class StepOutput:
    """One decode step for the whole batch (row i belongs to the i-th running sequence)."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def sample_step(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    max_top_logprobs: int = 0,
    fast: bool = False,
) -> StepOutput:
    """Pick one token per row of ``logits_BV`` and report its raw log-probability.

    ``fast``: take each row's maximum, first argmax and log-sum-exp from the engine's C kernel
    (:func:`agentbolt.engine.kernels.row_stats`) instead of a float32 copy of the logits, a
    log-softmax over the vocabulary and an argmax; the same tokens, and log-probabilities by the
    same formula (``(logit - max) - logsum``) with the sum taken in another order."""
    stats = kernels.row_stats(logits_BV) if fast else None
    if stats is None:
        logits_BV = logits_BV.float()
        source_BV = torch.log_softmax(logits_BV, dim=-1)  # what gather and topk read: logprobs

        def logprobs(values_BK: torch.Tensor) -> torch.Tensor:
            return values_BK

    else:
        top_B, argmax_B, logsum_B = stats
        source_BV = logits_BV  # logits, turned into logprobs by the row's max and log-sum-exp

        def logprobs(values_BK: torch.Tensor) -> torch.Tensor:
            return (values_BK.float() - top_B[:, None]) - logsum_B[:, None]

    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if len(sampled) == len(params):  # every row sampled (rollouts): no argmax, no copy of the logits
        tokens_B = _sample_rows(logits_BV.float(), params, generators)
    else:
        tokens_B = first_argmax(logits_BV) if stats is None else argmax_B
        if sampled:
            rows = torch.tensor(sampled)
            tokens_B[rows] = _sample_rows(
                logits_BV[rows].float(), [params[i] for i in sampled], [generators[i] for i in sampled]
            )
    chosen_B = logprobs(source_BV.gather(1, tokens_B[:, None])).squeeze(1)
    top_ids = top_lps = None
    if max_top_logprobs > 0:
        top_vals_BK, top_idx_BK = source_BV.topk(max_top_logprobs, dim=-1)
        top_ids, top_lps = top_idx_BK.tolist(), logprobs(top_vals_BK).tolist()
    return StepOutput(tokens_B.tolist(), chosen_B.tolist(), top_ids, top_lps)


def first_argmax(x_BV: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``torch.argmax(x_BV, dim=-1)`` (the first index of each row's maximum), found block-wise.

    PyTorch's CPU argmax over a vocabulary-wide row is about ten times slower than ``amax``
    (2.4-5.4 ms against 0.26 ms for 32 x 49152 float32, one thread): here the row maximum comes
    from ``amax`` over blocks, the first block holding it from a short argmax, and the index from
    an argmax inside that block, which gives the same first index as ``torch.argmax``.
    """
    rows, width = x_BV.shape
    if width % block or width < 4 * block or not x_BV.is_contiguous():
        return torch.argmax(x_BV, dim=-1)
    block_max_BN = x_BV.view(rows, width // block, block).amax(dim=-1)
    if torch.isnan(block_max_BN).any():  # amax propagates NaN; argmax's rule for it is its own
        return torch.argmax(x_BV, dim=-1)
    first_block_B = torch.argmax(block_max_BN, dim=-1)  # argmax returns the first maximum
    starts_B = first_block_B * block
    inside_BK = x_BV.gather(1, starts_B[:, None] + torch.arange(block)[None, :])
    return starts_B + torch.argmax(inside_BK, dim=-1)


def _sample_rows(
    logits_RV: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
) -> torch.Tensor:
    """One token per row by inverse-CDF sampling, each row's uniform number from its own generator.

    Rows without truncation (``top_p`` 1, no ``top_k``: what RL rollouts use) search the
    cumulative sum of their probabilities in vocabulary order; rows with only ``top_k`` that of
    their ``k`` largest (``topk``); nucleus rows take their 1,024 largest first and sort the whole
    vocabulary only when those do not hold the nucleus. For SmolLM2's 49,152 tokens and 32 rows,
    2 threads, sampling every row at temperature 1 took 81 ms per decode step when every sampled
    row was sorted (the sort alone about 50 ms), and takes 7-11 ms now, against 1.8-4.7 ms for greedy
    rows (``benchmarks/update_parts.py --sampling``)."""
    temps_R = torch.tensor([p.temperature for p in params], dtype=logits_RV.dtype)
    probs_RV = torch.softmax(logits_RV / temps_R[:, None], dim=-1)
    u_R = torch.cat([torch.rand(1, generator=g) for g in gens])
    vocab = probs_RV.shape[1]
    out_R = torch.empty(len(params), dtype=torch.long)
    plain, top_k, nucleus = [], [], []
    for i, p in enumerate(params):
        if p.top_p < 1.0:
            nucleus.append(i)
        elif 0 < p.top_k < vocab:
            top_k.append(i)
        else:
            plain.append(i)
    if len(plain) == len(params):
        return _inverse_cdf(probs_RV, u_R)
    if plain:
        out_R[plain] = _inverse_cdf(probs_RV[plain], u_R[plain])
    if top_k:
        ks_R1 = torch.tensor([[params[i].top_k] for i in top_k])
        vals_RK, idx_RK = probs_RV[top_k].topk(int(ks_R1.max()), dim=-1)  # sorted, largest first
        vals_RK = vals_RK * (torch.arange(vals_RK.shape[1])[None, :] < ks_R1)
        out_R[top_k] = idx_RK.gather(1, _inverse_cdf(vals_RK, u_R[top_k])[:, None]).squeeze(1)
    if nucleus:
        # top-k and top-p both cut a prefix of the sorted distribution: the largest NUCLEUS_HEAD
        # probabilities are enough when, in every row, they reach top_p or top_k (an LLM's
        # distribution usually does), else the whole vocabulary is sorted
        sub_params = [params[i] for i in nucleus]
        probs_NV = probs_RV[nucleus]
        head = min(NUCLEUS_HEAD, vocab)
        sorted_NK, order_NK = probs_NV.topk(head, dim=-1)
        if head < vocab and not _head_suffices(sorted_NK, sub_params):
            sorted_NK, order_NK = probs_NV.sort(dim=-1, descending=True)
        sorted_NK = sorted_NK * _truncation_mask(sorted_NK, sub_params)
        out_R[nucleus] = order_NK.gather(1, _inverse_cdf(sorted_NK, u_R[nucleus])[:, None]).squeeze(1)
    return out_R


NUCLEUS_HEAD = 1024
"""How many of a nucleus row's largest probabilities are taken first (``topk``) before sorting all."""


def _head_suffices(sorted_NK: torch.Tensor, params: list[SamplingParams]) -> bool:
    """Whether every row's cut lies inside its ``K`` largest probabilities (sorted, largest first):
    their mass reaches the row's top_p (the mass before the last of them is at least top_p, so the
    nucleus is decided inside them) or its top_k is at most K."""
    k = sorted_NK.shape[1]
    mass_before_last_N = sorted_NK.sum(dim=-1) - sorted_NK[:, -1]
    for n, p in enumerate(params):
        if not (0 < p.top_k <= k or float(mass_before_last_N[n]) >= p.top_p):
            return False
    return True


def _inverse_cdf(weights_RN: torch.Tensor, u_R: torch.Tensor) -> torch.Tensor:
    """The column where each row's cumulative weight first exceeds ``u`` times the row's total:
    column ``j`` with probability ``weights[j] / total``, never a column of weight 0."""
    cdf_RN = weights_RN.cumsum(dim=-1)
    total_R1 = cdf_RN[:, -1:]
    pos_R = torch.searchsorted(cdf_RN, u_R[:, None] * total_R1, right=True).squeeze(1)
    # u * total may round up to the total itself: searchsorted then passes the last column of
    # positive weight (the first whose cumulative weight reaches the total)
    over = pos_R >= cdf_RN.shape[1]
    if over.any():
        pos_R[over] = (cdf_RN[over] < total_R1[over]).sum(dim=-1)
    return pos_R


def _truncation_mask(sorted_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = sorted_RV.shape[1]
    top_p_R1 = torch.tensor([[p.top_p] for p in params], dtype=sorted_RV.dtype)
    top_k_R1 = torch.tensor([[p.top_k if p.top_k > 0 else vocab] for p in params])
    ranks_1V = torch.arange(vocab)[None, :]
    # Keep a token if the mass before it is below top_p (so the first token is always kept).
    mass_before_RV = sorted_RV.cumsum(dim=-1) - sorted_RV
    return ((mass_before_RV < top_p_R1) & (ranks_1V < top_k_R1)).to(sorted_RV.dtype)
