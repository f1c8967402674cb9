"""The curve sampler: a drawn log-probability transfer curve, or the HLG tone curve's knobs,
in place of temperature (pure: the engine's gpu/curve.py applies them on the GPU).

A token's log-probability `u` (at temperature 1, after bias, penalties and a grammar's mask)
is mapped through a monotone curve `f`, and the next token is drawn with probability
proportional to `exp(f(u))`. The identity curve is sampling at temperature 1.0; a straight
line of slope `1/T` through the origin is temperature `T`; anything else shapes the head and
the tail of the distribution separately, which one temperature cannot.

- **A drawn curve** (`curve: {"points": [[u, y], ...]}`): 2 to 64 points, `u` strictly
  increasing within [CURVE_UMIN, 0], `y` never decreasing (a curve that falls anywhere would
  make a less likely token likelier than a more likely one: a 400). Between points it is
  straight; beyond the first and last point it goes on with the end segments' slopes.
- **The HLG tone curve** (`hlg: {"enabled": true, "width", "shoulder", "toe",
  "pivot_offset"}`), named after the hybrid log-gamma curve of HDR video: measured from the
  likeliest token (`x = u - max u`), tokens within `pivot_offset` nats of it are the head and
  fall with slope `h = 1 / (1 + shoulder / 4)`, the rest the tail and fall with slope
  `t = 1 + toe / 4`, the knee between them softened over about `width` nats (the slope
  goes from 10% to 90% of the way between them there):

      s = width / 4
      f(x) = h * x - (t - h) * s * log(1 + exp(-(x + pivot_offset) / s))

  Monotone by construction. `shoulder` 0 and `toe` 0 are the identity. The defaults (width 4,
  shoulder 4, toe 6, pivot_offset 6, the reference server's) sample the head as at
  temperature 2 and the tail as at temperature 0.4: varied wording among plausible tokens,
  and the long tail of junk pushed further away.

A request's `hlg` goes over the model's default (`[models.NAME.defaults.hlg]`, else
`[defaults.hlg]`) field by field; a drawn `curve` wins over both.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated

import msgspec
from msgspec import Meta

CURVE_UMIN = -30.0  # the curve designer's left edge: log-probabilities below are extrapolated
MIN_POINTS, MAX_POINTS = 2, 64
SIGNAL_BINS = 80  # POST /signal's histogram: bins over [CURVE_UMIN, 0]
HLG_DEFAULTS = {"width": 4.0, "shoulder": 4.0, "toe": 6.0, "pivot_offset": 6.0}

Knob = Annotated[float, Meta(ge=0.0, le=64.0)]
Positive = Annotated[float, Meta(gt=0.0, le=64.0)]


class Hlg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """The HLG tone curve's knobs (each unset one: the model's default, else HLG_DEFAULTS)."""

    enabled: bool | None = None
    width: Positive | None = None
    shoulder: Knob | None = None
    toe: Knob | None = None
    pivot_offset: Positive | None = None

    def over(self, base: Hlg | None) -> Hlg:
        """These knobs, and `base`'s where these leave one unset."""
        if base is None:
            return self
        mine = {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}
        return Hlg(**{**msgspec.structs.asdict(base), **mine})


class Curve(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A drawn transfer curve: `points` as [log-probability, output] pairs."""

    points: Annotated[list[tuple[float, float]], Meta(min_length=2, max_length=MAX_POINTS)]


HlgKnobs = tuple[float, float, float, float]  # width, shoulder, toe, pivot_offset
Points = tuple[tuple[float, float], ...]


def resolve_hlg(request: Hlg | None, default: Hlg | None) -> HlgKnobs | None:
    """The HLG knobs a request samples with (None: HLG off): its own over the model's default."""
    merged = request.over(default) if request is not None else default
    if merged is None or not merged.enabled:
        return None
    knobs = {**HLG_DEFAULTS, **{k: v for k, v in msgspec.structs.asdict(merged).items() if v is not None}}
    return (float(knobs["width"]), float(knobs["shoulder"]), float(knobs["toe"]), float(knobs["pivot_offset"]))


def curve_problem(points: list[tuple[float, float]] | Points) -> str | None:
    """Why `points` is not a curve the sampler takes (None: it is)."""
    if not MIN_POINTS <= len(points) <= MAX_POINTS:
        return f"a curve has {MIN_POINTS} to {MAX_POINTS} points; this one has {len(points)}"
    for u, y in points:
        if not (math.isfinite(u) and math.isfinite(y)):
            return "a curve's points must be finite numbers"
        if not CURVE_UMIN <= u <= 0.0:
            return f"a curve's log-probabilities (its points' first values) lie in [{CURVE_UMIN:g}, 0]; {u:g} does not"
        if abs(y) > 1e4:
            return f"a curve's outputs (its points' second values) lie within ±10000; {y:g} does not"
    for (u0, y0), (u1, y1) in itertools.pairwise(points):
        if u1 <= u0:
            return f"a curve's log-probabilities must increase from point to point; {u1:g} follows {u0:g}"
        if y1 < y0:
            return (f"curve is not monotone: it falls from {y0:g} at {u0:g} to {y1:g} at {u1:g} "
                    "(every segment's slope must be >= 0)")
    return None



def hlg_slopes(shoulder: float, toe: float) -> tuple[float, float]:
    """The head's and the tail's slopes."""
    return 1.0 / (1.0 + shoulder / 4.0), 1.0 + toe / 4.0


def hlg_value(x: float, knobs: HlgKnobs) -> float:
    """f(x) for `x` a log-probability less the likeliest token's (the engine computes the same)."""
    width, shoulder, toe, pivot = knobs
    head, tail = hlg_slopes(shoulder, toe)
    s = width / 4.0
    z = -(x + pivot) / s
    soft = z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))
    return head * x - (tail - head) * s * soft


def curve_value(points: Points, u: float) -> float:
    """f(u) of a drawn curve: straight between points, the end segments' slopes beyond them."""
    first = 0 if u <= points[1][0] else len(points) - 2
    for i in range(len(points) - 1):
        if points[i][0] <= u <= points[i + 1][0]:
            first = i
            break
    (u0, y0), (u1, y1) = points[first], points[first + 1]
    return y0 + (u - u0) * (y1 - y0) / (u1 - u0)


# ---- the curve designer's calls (engine/http/curve_routes.py) ----

PROMPT_CHARS = 32_000


class SignalRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    prompt: Annotated[str, Meta(max_length=PROMPT_CHARS)] = ""
    model: str | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    prompt: Annotated[str, Meta(max_length=PROMPT_CHARS)] = ""
    model: str | None = None
    curve: Curve | None = None
    hlg: Hlg | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 3
    max_tokens: Annotated[int, Meta(ge=1, le=256)] = 80
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    default: bool = False


class Likely(msgspec.Struct):
    token: int
    text: str
    logprob: float


class Signal(msgspec.Struct):
    model: str
    bins: list[int]  # tokens whose log-probability lies in each bin, left (CURVE_UMIN) to right (0)
    umin: float
    vocab: int
    prompt_tokens: int
    top: list[Likely]


class Sample(msgspec.Struct):
    text: str
    junk: bool
    finish_reason: str


class Generated(msgspec.Struct, omit_defaults=True):
    model: str
    mode: str  # "curve", "hlg" or "default"
    n: int
    seed: int
    samples: list[Sample]
    recipe: dict[str, float] | None = None  # the model's own sampling, in "default" mode
