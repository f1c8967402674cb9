"""Which drafted tokens a row keeps: greedy agreement, or rejection sampling (GPU thread).

The target ran once over the row's last token and its `m` drafts, so it has `m + 1`
distributions: position j's says what follows the draft before it. Greedy rows keep drafts
while each equals the target's argmax, then take the target's own token (a correction, or a
bonus after all `m`): the text is the one decoding without drafts gives. Sampled rows use
speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with a draft whose
distribution `q` is one token (an n-gram's, or a greedy draft model's): draft d is kept with
probability p(d), and at the first refusal the token is drawn from p without d, renormalized,
which is p's own distribution for that position. So the reply keeps the target's
distribution, after its temperature and top-p / top-k / min-p filters.

Seeded rows (`keys`: one random key per position, gpu/sampling.py's `token_key` of the
token's place in the reply) sample each position from p with that position's own key, as
decoding without drafts does, and keep drafts while each equals the target's sample. Every
token is then the one decoding without drafts draws, whatever was drafted, so a seeded reply
is the same with drafts or without, and goes on with the same draws after a resume. With a
one-token draft it keeps d with the same probability p(d) as the rejection scheme above.

Everything that decides is computed in one evaluation, so a verification costs the host one
wait on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxd.engine.gpu.sampling import sampling_filters


@dataclass(frozen=True, slots=True)
class Distribution:
    """How the row samples: greedy (`temp` 0) or from the filtered, tempered distribution."""

    temp: float
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0 or self.top_k == 1

    def logits(self, logprobs: mx.array) -> mx.array:
        """The tempered logits of what the row samples from (filtered tokens at -inf)."""
        for method in sampling_filters(self.top_p, self.min_p, self.top_k):
            logprobs = method(logprobs)
        return logprobs * (1.0 / self.temp)

    def sample(self, logprobs: mx.array, key: Any = None) -> mx.array:
        """One token per row of `logprobs` (lazy)."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.logits(logprobs), key=key)


def accept(dist: Distribution, logprobs: mx.array, drafts: list[int], keys: list[Any] | None = None) -> list[int]:
    """The tokens the row emits from one verification: the kept drafts, then one of the target's.

    `logprobs` is (m + 1, vocab), after the row's logits processors, position j following
    draft j (the row's last token for j = 0). `keys` (a seeded row's, one a position) make the
    target's tokens its own draws at each position; without them the draws are MLX's global
    generator's.
    """
    m = len(drafts)
    if dist.greedy or keys is not None:
        targets = (mx.argmax(logprobs, axis=-1) if dist.greedy or keys is None
                   else mx.concatenate([dist.sample(logprobs[j:j + 1], keys[j]) for j in range(m + 1)]))
        mx.eval(targets)
        chosen: list[int] = targets.tolist()  # type: ignore[assignment]
        n = 0
        while n < m and drafts[n] == chosen[n]:
            n += 1
        return [*drafts[:n], chosen[n]]
    tempered = dist.logits(logprobs)
    bonus = mx.random.categorical(tempered[m])
    if m == 0:
        mx.eval(bonus)
        return [as_int(bonus)]
    ids = mx.array(drafts)
    probs = mx.softmax(tempered[:m], axis=-1, precise=True)
    kept_p = mx.take_along_axis(probs, ids[:, None], axis=-1)[:, 0]
    draws = mx.random.uniform(shape=(m,))
    # Where a draft is refused: p with the draft taken out (its own draw for each position).
    residual = mx.where(mx.arange(tempered.shape[-1])[None, :] == ids[:, None], -mx.inf, tempered[:m])
    fixes = mx.random.categorical(residual)
    mx.eval(bonus, kept_p, draws, fixes)
    keep: list[bool] = (draws < kept_p).tolist()  # type: ignore[assignment]
    n = 0
    while n < m and keep[n]:
        n += 1
    return [*drafts[:n], as_int(bonus) if n == m else as_int(fixes[n])]


def as_int(value: mx.array) -> int:
    return int(value.reshape(-1).tolist()[0])  # type: ignore[arg-type, index]
