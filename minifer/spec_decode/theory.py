"""How much speculative decoding can win: Leviathan et al. (2023), section 3; chapter 04.

The model: each draft token is accepted independently with probability ``α`` (the acceptance rate; for a sampled
draft ``α = Σ_x min(p(x), q(x))``, ``1 -`` the total variation distance between target and draft). A step proposes
``k`` tokens and runs the target once over them all, so it emits ``1 + A`` tokens: the ``A`` accepted drafts before
the first rejection, plus the target's own (the correction at the rejection, or the bonus after ``k`` acceptances).
``A ≥ i`` (the first ``i`` drafts accepted) has probability ``α^i``, so

    E[1 + A] = Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α)        (k + 1 when α = 1),

a truncated geometric series: each extra draft is worth less, since it counts only if all those before it survived.

Cost: with ``c`` a draft step's time over a target step's, and verification costing one target step (true while
decoding is memory-bound: k + 1 positions read the weights once, like one), a step costs ``k·c + 1`` target steps,
so the expected speedup over plain decoding is ``E[1 + A] / (k·c + 1)``.
"""

from __future__ import annotations

import math

__all__ = ["expected_tokens_per_forward", "expected_accepted", "expected_speedup", "optimal_k", "acceptance_rate",
           "estimate_alpha"]


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the acceptance rate) must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_k(k: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{name} (the number of draft tokens per step) must be an integer >= 0, got {k!r}")
    return k


def _check_cost(draft_cost: float) -> float:
    if (isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float)) or math.isnan(draft_cost)
            or not 0 <= draft_cost < math.inf):
        raise ValueError(f"draft_cost (draft step time / target step time) must be a finite number >= 0, "
                         f"got {draft_cost!r}")
    return float(draft_cost)


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """Expected tokens emitted per target forward pass, ``(1 − α^(k+1)) / (1 − α)``; 1 at ``k = 0``. Summed as
    ``Σ_{i=0..k} α^i``, which is exact at ``α = 1`` (``k + 1``) and has no cancellation near it."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    return math.fsum(alpha**i for i in range(k + 1))


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted drafts per step, ``E[A] = α (1 − α^k) / (1 − α)``: :func:`expected_tokens_per_forward` - 1."""
    return expected_tokens_per_forward(alpha, k) - 1.0


def expected_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Expected wall-clock speedup over plain decoding, ``E[1 + A] / (k·c + 1)`` (Leviathan et al., eq. 1
    and theorem 3.8), with ``c = draft_cost`` the draft's step time over the target's."""
    return expected_tokens_per_forward(alpha, k) / (k * _check_cost(draft_cost) + 1.0)


def optimal_k(alpha: float, draft_cost: float, k_max: int = 8) -> int:
    """The ``k`` in ``0 .. k_max`` with the largest :func:`expected_speedup` (the smallest on a tie). 0 means
    speculation does not pay (at ``k = 1`` the speedup is ``(1 + α) / (1 + c)``, so ``α ≤ c`` rules that out)."""
    alpha, draft_cost, k_max = _check_alpha(alpha), _check_cost(draft_cost), _check_k(k_max, "k_max")
    speedups = [expected_speedup(alpha, k, draft_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (speedups[k], -k))


def _check_counts(accepted: int, proposed: int) -> None:
    for name, value in (("accepted", accepted), ("proposed", proposed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if proposed == 0:
        raise ValueError("proposed is 0: no draft token was proposed, so there is no acceptance rate to estimate")
    if accepted > proposed:
        raise ValueError(f"accepted ({accepted}) cannot exceed proposed ({proposed})")


def acceptance_rate(accepted: int, proposed: int) -> float:
    """The fraction of draft tokens accepted, as vLLM reports it (``num_accepted_tokens / num_draft_tokens``). With
    ``k > 1`` this is *not* ``α``: drafts after a rejection are proposed but never checked, so under the i.i.d.
    model it tends to ``E[A] / k``, below ``α`` (see :func:`estimate_alpha`)."""
    _check_counts(accepted, proposed)
    return accepted / proposed


def estimate_alpha(accepted: int, proposed: int, k: int = 1) -> float:
    """The per-token acceptance probability ``α`` from counts of steps that each proposed ``k`` tokens. With
    ``k = 1`` every proposed token is checked: ``accepted / proposed``. With ``k > 1`` the mean accepted per step,
    ``accepted / (proposed / k)``, is matched by bisection to ``E[A]``, which grows from 0 to ``k`` with ``α``."""
    _check_counts(accepted, proposed)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens proposed per step) must be an integer >= 1, got {k!r}")
    if k == 1 or accepted in (0, proposed):
        return accepted / proposed
    target = k * accepted / proposed  # mean accepted per step
    lo, hi = 0.0, 1.0
    for _ in range(60):  # 2^-60: far below any count's resolution
        mid = (lo + hi) / 2
        if expected_accepted(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
