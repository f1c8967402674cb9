"""The curve sampler on the GPU: logits processors mapping each token's log-probability through
a drawn curve or the HLG tone curve (mlxd/protocol/curve.py says what they mean).

Applied last, after bias, penalties and a grammar's mask, in either lane (mlx-lm's processor
interface: `(tokens, logits) -> logits`); the sampler then draws at temperature 1.0, so the
curve replaces temperature. A masked token (-inf) stays masked whatever the curve does there.
A drawn curve is evaluated in hinge form: its first segment's line plus, at each later point,
the change of slope times `max(0, u - u_i)`, which is the straight-line interpolation with the
end segments' slopes carried on beyond the ends.
"""

from __future__ import annotations

import itertools

import mlx.core as mx

from mlxd.protocol.curve import HlgKnobs, Points, hlg_slopes


def _log_probs(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _keep_masked(logits: mx.array, shaped: mx.array) -> mx.array:
    return mx.where(logits == -mx.inf, -mx.inf, shaped)


class CurveProcessor:
    """A drawn curve through `points` ([(log-probability, output)], checked by curve_problem)."""

    def __init__(self, points: Points) -> None:
        us = [u for u, _ in points]
        slopes = [(y1 - y0) / (u1 - u0) for (u0, y0), (u1, y1) in itertools.pairwise(points)]
        self._u0, self._y0, self._s0 = us[0], points[0][1], slopes[0]
        self._knees = mx.array(us[1:-1], dtype=mx.float32)  # where the slope changes...
        self._turns = mx.array([b - a for a, b in itertools.pairwise(slopes)], dtype=mx.float32)  # ... by this

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        u = _log_probs(logits)
        y = self._y0 + self._s0 * (u - self._u0)
        if self._knees.size:
            y = y + (mx.maximum(u[..., None] - self._knees, 0.0) * self._turns).sum(axis=-1)
        return _keep_masked(logits, y)


class HlgProcessor:
    """The HLG tone curve with these knobs, measured from the likeliest token."""

    def __init__(self, knobs: HlgKnobs) -> None:
        width, shoulder, toe, self._pivot = knobs
        self._soft = width / 4.0  # the knee's softness (protocol/curve.py)
        self._head, self._tail = hlg_slopes(shoulder, toe)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        u = _log_probs(logits)
        x = u - u.max(axis=-1, keepdims=True)
        soft = self._soft * mx.logaddexp(mx.zeros_like(x), -(x + self._pivot) / self._soft)
        return _keep_masked(logits, self._head * x - (self._tail - self._head) * soft)
