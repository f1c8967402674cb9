"""A file fetched from the hub into the hub cache so that an interrupted run can resume it.

huggingface_hub 2.x downloads into a temporary file it deletes when the download fails, so a
second `mlxd pull` would start a 5 GB weight file over. A `PartialDownload` appends to
`blobs/<etag>.mlxd-partial` (a stable name the next run finds) with Range GETs, checks the
whole file against the hub's size and sha256, and moves it to `blobs/<etag>`, where
`hf_hub_download` finds it and only links it into the snapshot.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import constants
from huggingface_hub.utils import (
    build_hf_headers,
    hf_raise_for_status,
    http_stream_backoff,
    is_tqdm_disabled,
    tqdm,
)

from mlxd.protocol.units import format_size

SHA256_RE = re.compile(r"[0-9a-f]{64}")  # an LFS file's etag: the sha256 of its content
CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-\d+/(?:\d+|\*)$")
PARTIAL_SUFFIX = ".mlxd-partial"
NUM_TRIES = 5  # GETs in a row that bring no byte before a run gives up (as huggingface_hub's http_get)


class PullError(Exception):
    """A pull that cannot go on; `str()` is the one line for the user."""


def answer_start(status: int, content_range: str | None) -> int | None:
    """The offset a GET's answer starts at: 0 for a whole file, a 206's first byte, None for others."""
    if status == 200:
        return 0
    match = CONTENT_RANGE_RE.match(content_range or "") if status == 206 else None
    return int(match.group(1)) if match else None


def download_headers(url: str, location: str) -> dict[str, str]:
    """The hub's headers for a GET of `location`, without the token when it leaves the hub (a CDN)."""
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"  # byte ranges of the file itself, not of a gzip of it
    if _origin(location) not in {_origin(url), _origin(constants.ENDPOINT)}:
        headers.pop("authorization", None)
    return headers


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


class PartialDownload:
    """One file fetched into `blobs/<etag>.mlxd-partial` with Range GETs, then moved to `blobs/<etag>`.

    The partial file outlives the run, so the next run appends to it; its caller holds a lock on it.
    """

    def __init__(self, name: str, blob: Path, url: str, headers: dict[str, str], size: int) -> None:
        self.name = name
        self.blob = blob
        self.partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
        self.url = url
        self.headers = headers
        self.size = size
        self.num_new_bytes = 0  # fetched by this run

    def num_fetched(self) -> int:
        """The bytes in the partial file (0 when there is none)."""
        try:
            return self.partial.stat().st_size
        except FileNotFoundError:
            return 0

    def progress(self) -> str:
        return f"{format_size(self.num_fetched())} of {format_size(self.size)} fetched"

    def run(self, bar_class: type[tqdm], on_retry: Callable[[BaseException], None]) -> None:
        """Fetch what the partial file lacks, check it, and make it the blob."""
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        if self.num_fetched() > self.size:  # cannot be a start of this file
            self.partial.unlink()
        log_level = logging.getLogger("huggingface_hub").getEffectiveLevel()
        with bar_class(total=self.size, initial=self.num_fetched(), unit="B", unit_scale=True,
                       disable=is_tqdm_disabled(log_level), name="huggingface_hub.http_get") as bar:
            self._fetch_rest(bar, on_retry)
        self._check()
        os.replace(self.partial, self.blob)

    def _fetch_rest(self, bar: tqdm, on_retry: Callable[[BaseException], None]) -> None:
        """GET until the partial is whole; a dropped connection is tried again while tries bring bytes."""
        num_failures = 0
        while (num_had := self.num_fetched()) < self.size:
            error: httpx2.TransportError | None = None
            try:
                self._get(bar)
            except httpx2.TransportError as exc:  # dropped, timed out, refused
                error = exc
            num_failures = 0 if self.num_fetched() > num_had else num_failures + 1
            if num_failures >= NUM_TRIES:
                raise error or OSError(f"the hub sends nothing past byte {num_had}")
            if error is not None:
                on_retry(error)
                time.sleep(1)

    def _get(self, bar: tqdm) -> None:
        """One GET from where the partial file ends, appended to it (or written over it from byte 0)."""
        num_had = self.num_fetched()
        headers = {**self.headers, "Range": f"bytes={num_had}-"} if num_had else self.headers
        with http_stream_backoff("GET", self.url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                 retry_on_exceptions=(), retry_on_status_codes=(408, 429)) as response:
            start = answer_start(response.status_code, response.headers.get("Content-Range"))
            if num_had and response.status_code in (200, 206, 416) and start != num_had:
                # The Range was ignored (200), refused (416) or answered from elsewhere: start over.
                self.partial.unlink()
                bar.reset()
                if start != 0:
                    return
            hf_raise_for_status(response)
            # Unbuffered, each chunk written as it comes: a cut or a kill keeps every byte received.
            with self.partial.open("ab" if start else "wb", buffering=0) as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    self.num_new_bytes += len(chunk)
                    bar.update(len(chunk))

    def _check(self) -> None:
        """PullError, and the partial file deleted, unless it is the file the hub describes."""
        num_bytes = self.num_fetched()
        etag = self.blob.name
        if num_bytes != self.size:
            problem = f"{num_bytes} bytes where the hub says {self.size}"
        elif SHA256_RE.fullmatch(etag) and _sha256(self.partial) != etag:
            problem = f"its sha256 is not {etag}, the one the hub gives"
        else:
            return
        self.partial.unlink(missing_ok=True)
        raise PullError(f"{self.name} came down corrupt ({problem}); deleted it: "
                        "run the same command again to fetch it from the start")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextmanager
def exclusive(lock_path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold an flock on `lock_path`; `on_wait()` first when another process holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
