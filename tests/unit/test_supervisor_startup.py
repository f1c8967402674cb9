"""Supervisor start-up: aiohttp imported with its CA loading put off (quick_import.py), the event loop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import json, ssl, sys
    from mlxd.supervisor import quick_import
    deferred = quick_import.import_aiohttp()
    from aiohttp import connector
    ctx = connector._SSL_CONTEXT_VERIFIED
    before = len(ctx.get_ca_certs()) + ctx.cert_store_stats()["x509_ca"]
    restored = "set_default_verify_paths" not in ssl.SSLContext.__dict__
    loaded = quick_import.load_deferred_verify_paths()
    after = ctx.cert_store_stats()["x509_ca"]
    fresh = ssl.create_default_context().cert_store_stats()["x509_ca"]
    again = quick_import.import_aiohttp()
    print(json.dumps(dict(deferred=deferred, before=before, restored=restored, loaded=loaded,
                          after=after, fresh=fresh, again=again)))
    """
)


def test_ca_loading_is_deferred_then_done_on_the_same_contexts() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["deferred"] is True and got["again"] is False  # the second call is a no-op
    assert got["restored"], "ssl.SSLContext must get its own method back"
    assert got["before"] == 0, "aiohttp's contexts should hold no CA certs before the deferred load"
    assert got["loaded"] == 2  # aiohttp's verified and unverified client contexts
    # Afterwards they hold what a context built the usual way holds (0 on a system whose CAs
    # live only in a hashed dir, which OpenSSL reads lazily: then both sides are 0).
    assert got["after"] == got["fresh"]


def test_event_loop_choice() -> None:
    import uvloop

    from mlxd.event_loop import loop_factory

    assert loop_factory({}) is uvloop.new_event_loop
    assert loop_factory({"MLXD_EVENT_LOOP": "uvloop"}) is uvloop.new_event_loop
    assert loop_factory({"MLXD_EVENT_LOOP": "asyncio"}) is None
    assert loop_factory({"MLXD_EVENT_LOOP": "bogus"}) is None
