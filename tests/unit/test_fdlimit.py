"""The open-file soft limit both processes raise at start."""

from __future__ import annotations

import resource

from mlxd.fdlimit import DARWIN_OPEN_MAX, WANT, raise_open_file_limit, target_soft_limit


def test_target_is_want_within_the_hard_limit_and_never_lower() -> None:
    assert target_soft_limit(1024, 1_048_576, "linux") == WANT
    assert target_soft_limit(1024, 4096, "linux") == 4096
    assert target_soft_limit(200_000, 1_048_576, "linux") == 200_000  # already higher: left alone


def test_macos_stays_at_open_max_even_with_an_unlimited_hard_limit() -> None:
    inf = resource.RLIM_INFINITY
    assert target_soft_limit(256, inf, "darwin", infinity=inf) == DARWIN_OPEN_MAX
    assert target_soft_limit(256, 1024, "darwin") == 1024
    assert target_soft_limit(256, inf, "linux", infinity=inf) == WANT


def test_raising_applies_to_this_process() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        now = raise_open_file_limit()
        expected = target_soft_limit(lowered, hard, infinity=resource.RLIM_INFINITY)
        assert now == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert expected > lowered or hard == lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
