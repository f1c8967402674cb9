"""The curve sampler's parts: what a curve or HLG knobs must be (mlxd/protocol/curve.py) and the
processors that apply them (mlxd/engine/gpu/curve.py) against the formulas the docs give."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import msgspec
import pytest

from mlxd.engine.gpu.curve import CurveProcessor, HlgProcessor
from mlxd.protocol.curve import (
    CURVE_UMIN,
    HLG_DEFAULTS,
    Curve,
    Hlg,
    curve_problem,
    curve_value,
    hlg_value,
    resolve_hlg,
)
from mlxd.protocol.sampling import Defaults

IDENTITY = ((CURVE_UMIN, CURVE_UMIN), (0.0, 0.0))


@pytest.mark.parametrize(("points", "why"), [
    ([(-5.0, 0.0)], "2 to 64 points"),
    ([(-5.0, -5.0), (-2.0, -6.0), (0.0, 0.0)], "not monotone"),
    ([(-5.0, -5.0), (-5.0, -4.0)], "must increase"),
    ([(-40.0, -5.0), (0.0, 0.0)], "lie in [-30, 0]"),
    ([(-5.0, -5.0), (1.0, 0.0)], "lie in [-30, 0]"),
    ([(-5.0, float("nan")), (0.0, 0.0)], "finite"),
    ([(-5.0, -1e6), (0.0, 0.0)], "within"),
])
def test_a_curve_that_cannot_be_sampled_says_why(points: list[tuple[float, float]], why: str) -> None:
    problem = curve_problem(points)
    assert problem is not None and why in problem


def test_flat_and_rising_curves_are_taken() -> None:
    assert curve_problem(list(IDENTITY)) is None
    assert curve_problem([(-30.0, -60.0), (-6.0, -6.0), (-2.0, -1.0), (0.0, -1.0)]) is None  # flat at the top


def test_the_wire_shapes_are_strict() -> None:
    assert msgspec.json.decode(b'{"points": [[-30, -30], [0, 0]]}', type=Curve).points == [(-30.0, -30.0), (0.0, 0.0)]
    for bad in (b'{"points": [[-1, 0, 2], [0, 0]]}', b'{"points": "x"}', b'{"pts": []}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=Curve)
    for bad in (b'{"width": 0}', b'{"toe": -1}', b'{"shoulder": "a"}', b'{"knee": 1}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=Hlg)


def test_hlg_knobs_go_over_the_models_default_one_by_one() -> None:
    assert resolve_hlg(None, None) is None
    assert resolve_hlg(Hlg(width=2.0), None) is None  # not enabled
    on = tuple(HLG_DEFAULTS.values())
    assert resolve_hlg(Hlg(enabled=True), None) == on
    default = Hlg(enabled=True, toe=2.0)
    assert resolve_hlg(None, default) == (4.0, 4.0, 2.0, 6.0)
    assert resolve_hlg(Hlg(shoulder=1.0), default) == (4.0, 1.0, 2.0, 6.0)
    assert resolve_hlg(Hlg(enabled=False), default) is None  # a request turns the model's off
    # the config's: a model's table over [defaults], knob by knob
    merged = Defaults(hlg=Hlg(width=8.0)).over(Defaults(hlg=Hlg(enabled=True, toe=1.0)))
    assert merged.hlg == Hlg(enabled=True, width=8.0, toe=1.0)


def test_the_hlg_curve_rises_everywhere_and_bends_at_the_pivot() -> None:
    knobs = tuple(HLG_DEFAULTS.values())
    xs = [-40 + 0.25 * i for i in range(161)]
    ys = [hlg_value(x, knobs) for x in xs]  # type: ignore[arg-type]
    assert all(b > a for a, b in itertools.pairwise(ys))
    head = (hlg_value(-0.5, knobs) - hlg_value(-1.5, knobs))  # type: ignore[arg-type]
    tail = (hlg_value(-30.0, knobs) - hlg_value(-31.0, knobs))  # type: ignore[arg-type]
    assert head == pytest.approx(0.5, abs=0.03)  # shoulder 4: slope 1 / (1 + 4/4)
    assert tail == pytest.approx(2.5, abs=0.01)  # toe 6: slope 1 + 6/4
    assert all(hlg_value(x, (4.0, 0.0, 0.0, 6.0)) == pytest.approx(x) for x in xs)  # the identity


def logits() -> mx.array:
    mx.random.seed(3)
    return mx.random.normal((2, 300)) * 4


def test_the_identity_curve_is_temperature_one() -> None:
    x = logits()
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    assert mx.allclose(CurveProcessor(IDENTITY)(mx.array([]), x), lp, atol=1e-4).item()


def test_a_line_of_slope_one_over_t_is_temperature_t() -> None:
    x = logits()
    got = CurveProcessor(((-30.0, -15.0), (0.0, 0.0)))(mx.array([]), x)  # T = 2
    want = x / 2.0 - mx.logsumexp(x / 2.0, axis=-1, keepdims=True)
    assert mx.allclose(got - mx.logsumexp(got, axis=-1, keepdims=True), want, atol=1e-4).item()


def test_a_drawn_curve_is_straight_between_its_points_and_carried_on_beyond() -> None:
    points = ((-20.0, -40.0), (-6.0, -8.0), (-2.0, -2.0), (0.0, -1.5))
    x = logits()
    lp = (x - mx.logsumexp(x, axis=-1, keepdims=True)).reshape(-1).tolist()
    got = CurveProcessor(points)(mx.array([]), x).reshape(-1).tolist()
    for u, y in zip(lp, got, strict=True):  # type: ignore[arg-type]
        assert y == pytest.approx(curve_value(points, u), abs=1e-3)
    assert curve_value(points, -25.0) == pytest.approx(-40.0 - 5 * 32 / 14)  # the first segment's slope
    assert curve_value(points, 1.0) == pytest.approx(-1.25)


def test_hlg_on_the_gpu_is_the_documented_formula() -> None:
    knobs = (3.0, 4.0, 6.0, 5.0)
    x = logits()
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    rel = (lp - lp.max(axis=-1, keepdims=True)).reshape(-1).tolist()
    got = HlgProcessor(knobs)(mx.array([]), x).reshape(-1).tolist()
    for r, y in zip(rel, got, strict=True):  # type: ignore[arg-type]
        assert y == pytest.approx(hlg_value(r, knobs), abs=1e-3)


@pytest.mark.parametrize("processor", [CurveProcessor(((-30.0, -5.0), (-10.0, -5.0), (0.0, 0.0))),
                                       HlgProcessor(tuple(HLG_DEFAULTS.values()))])  # type: ignore[arg-type]
def test_a_masked_token_stays_masked_even_where_the_curve_is_flat(processor: object) -> None:
    x = logits()
    x[:, 7] = -math.inf
    got = processor(mx.array([]), x)  # type: ignore[operator]
    assert mx.all(got[:, 7] == -math.inf).item()
    assert mx.all(mx.isfinite(got[:, :7])).item()
