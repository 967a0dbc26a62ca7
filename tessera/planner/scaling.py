"""Scaling-law helpers: converged loss vs model size, critical batch size, and the steps/data trade-off.

Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv 2001.08361), with the McCandlish et al.
2018 batch-size trade-off as used there; constants as listed, with their source, in docs/cost-model.md §8. The fits are for Kaplan's
WebText2 data and tokenizer (loss in nats per token), so absolute values transfer only roughly to other data; the
planner uses them to choose a batch size near B_crit and to turn a loss target into steps and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALPHA_B",
    "ALPHA_N",
    "ALPHA_S",
    "B_STAR",
    "N_C",
    "S_C",
    "TrainingEstimate",
    "critical_batch",
    "data_for_batch",
    "loss_from_params",
    "min_steps",
    "steps_for_batch",
    "training_at_critical_batch",
]

ALPHA_N = 0.076
"""Exponent of L(N) = (N_c/N)^α_N (Kaplan Table 5)."""
N_C = 8.8e13
"""Scale of L(N), non-embedding parameters."""
ALPHA_B = 0.21
"""Exponent of B_crit(L) = B*/L^(1/α_B)."""
B_STAR = 2.1e8
"""Scale of B_crit, tokens."""
ALPHA_S = 0.76
"""Exponent of L(N, S_min) = (N_c/N)^α_N + (S_c/S_min)^α_S."""
S_C = 2.1e3
"""Scale of S_min, optimizer steps."""


def loss_from_params(n_params: float) -> float:
    """Converged loss (nats/token) of a model with `n_params` non-embedding parameters: L(N) = (N_c/N)^α_N."""
    _positive(n_params=n_params)
    return (N_C / n_params) ** ALPHA_N


def critical_batch(loss: float) -> float:
    """Critical batch size in tokens at loss L: B_crit(L) = B* / L^(1/α_B) (Kaplan eq. 5.3)."""
    _positive(loss=loss)
    return B_STAR / loss ** (1 / ALPHA_B)


def min_steps(n_params: float, target_loss: float) -> float:
    """S_min, the steps needed at very large batch to reach `target_loss`, inverting Kaplan eq. 5.6
    L(N, S_min) = (N_c/N)^α_N + (S_c/S_min)^α_S ⇒ S_min = S_c / (L − L(N))^(1/α_S).
    Raises ValueError if the target is at or below the model's converged loss L(N)."""
    floor = loss_from_params(n_params)
    if target_loss <= floor:
        raise ValueError(
            f"target loss {target_loss:.4g} nats is not above the converged loss L(N) = {floor:.4g} of a "
            f"{n_params:.3g}-parameter model; choose a higher target or a larger model"
        )
    return S_C / (target_loss - floor) ** (1 / ALPHA_S)


def steps_for_batch(s_min: float, batch_tokens: float, b_crit: float) -> float:
    """Steps at batch B (tokens): S = S_min·(1 + B_crit/B), from (S/S_min − 1)(E/E_min − 1) = 1 (McCandlish)."""
    _positive(batch_tokens=batch_tokens)
    return s_min * (1 + b_crit / batch_tokens)


def data_for_batch(e_min: float, batch_tokens: float, b_crit: float) -> float:
    """Tokens processed at batch B: E = E_min·(1 + B/B_crit); E_min = B_crit·S_min."""
    return e_min * (1 + batch_tokens / b_crit)


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainingEstimate:
    """Steps and tokens to reach a loss target with a given model size and batch."""

    n_params: float
    target_loss: float
    critical_batch_tokens: float
    batch_tokens: float
    min_steps: float
    min_tokens: float
    steps: float
    tokens: float

    @property
    def train_flops(self) -> float:
        """≈ 6·N·tokens (forward + backward, no recompute, attention excluded; Kaplan's C = 6NBS)."""
        return 6 * self.n_params * self.tokens


def training_at_critical_batch(
    n_params: float, target_loss: float, *, batch_tokens: float | None = None
) -> TrainingEstimate:
    """Tokens and steps for an `n_params` model (non-embedding) to reach `target_loss`.

    B_crit = B_crit(target_loss); S_min from `min_steps`; E_min = B_crit·S_min. At B = B_crit (default):
    S = 2·S_min and E = 2·E_min.
    """
    b_crit = critical_batch(target_loss)
    s_min = min_steps(n_params, target_loss)
    e_min = b_crit * s_min
    batch = b_crit if batch_tokens is None else batch_tokens
    return TrainingEstimate(
        n_params=n_params,
        target_loss=target_loss,
        critical_batch_tokens=b_crit,
        batch_tokens=batch,
        min_steps=s_min,
        min_tokens=e_min,
        steps=steps_for_batch(s_min, batch, b_crit),
        tokens=data_for_batch(e_min, batch, b_crit),
    )


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
