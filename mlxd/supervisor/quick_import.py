"""Import aiohttp without loading the CA bundle on the supervisor's start-up path.

Importing `aiohttp.connector` builds two client `SSLContext`s, and each loads the system's CA
bundle: about 100 ms of a 500 ms supervisor start on a small machine. The supervisor makes no TLS
client connections (engines are on Unix sockets), so `serve` imports aiohttp with
`SSLContext.set_default_verify_paths` put off, and `load_deferred_verify_paths` runs it on those
same contexts from a thread once the supervisor answers. Until then a TLS client connection made
with aiohttp's default contexts fails certificate verification: it fails closed, never open.
"""

from __future__ import annotations

import ssl
import sys

_NAME = "set_default_verify_paths"
_deferred: list[ssl.SSLContext] = []


def import_aiohttp() -> bool:
    """Import aiohttp with its contexts' CA loading deferred; False if that could not be done."""
    if "aiohttp" in sys.modules or _NAME in ssl.SSLContext.__dict__:
        return False  # already imported, or someone else overrides the method: import as usual

    def defer(context: ssl.SSLContext) -> None:
        _deferred.append(context)

    setattr(ssl.SSLContext, _NAME, defer)
    try:
        import aiohttp  # noqa: F401
    finally:
        delattr(ssl.SSLContext, _NAME)  # back to the C method of ssl._SSLContext
    return True


def load_deferred_verify_paths() -> int:
    """Load the CA paths into the contexts `import_aiohttp` made; how many there were."""
    count = 0
    while _deferred:
        _deferred.pop().set_default_verify_paths()
        count += 1
    return count
