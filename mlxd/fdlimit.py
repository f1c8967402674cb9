"""Raise the open-file soft limit: every client connection and engine connection is a file.

macOS starts programs with a soft limit of 256 open files, which a few hundred queued requests
(each a client socket plus, once admitted, an engine socket) would exhaust. Both the supervisor
and the engine raise it at start, as far as the hard limit allows.
"""

from __future__ import annotations

import sys

WANT = 65536
DARWIN_OPEN_MAX = 10240  # macOS's setrlimit refuses a soft limit above OPEN_MAX, RLIM_INFINITY included


def target_soft_limit(soft: int, hard: int, platform: str = sys.platform, want: int = WANT,
                      infinity: int | None = None) -> int:
    """The soft limit to ask for: `want`, within the hard limit (and OPEN_MAX on macOS); never lower."""
    target = want if hard == infinity or hard < 0 else min(want, hard)
    if platform == "darwin":
        target = min(target, DARWIN_OPEN_MAX)
    return max(soft, target)


def raise_open_file_limit() -> int | None:
    """Apply target_soft_limit to RLIMIT_NOFILE; the soft limit now in force (None where unsupported)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = target_soft_limit(soft, hard, infinity=resource.RLIM_INFINITY)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
    return target
