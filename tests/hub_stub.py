"""A stand-in Hugging Face hub on a local port, for `mlxd pull` and lab push tests.

It answers what huggingface_hub 2.x asks (model_info, the tree listing, HEAD/GET of
`/{repo}/resolve/{rev}/{path}` with Range) with the headers it reads (X-Repo-Commit, ETag,
Content-Length), errors as the hub words them (404 + X-Error-Code RepoNotFound,
RevisionNotFound, EntryNotFound; 401 + GatedRepo), and never a xet header. It can cut one
file's download short on cue, the way a dropped connection would, answer a Range with the
whole file, as some proxies do, and send `*.safetensors` to a "CDN" (the same server under
another host name, so another origin) as the hub sends LFS files.

For pushes it takes what huggingface_hub's `create_repo` and `upload_folder` send (repo
creation, the pre-upload check, which it answers "regular" for every file, and the commit,
one NDJSON line a file with its bytes in base64) and keeps the files it was sent in `pushed`,
with the Authorization header each request carried; a `token` set makes any other a 401.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class StubRepo:
    """One model repo: its files (at a single commit) and the names that point at that commit."""

    files: dict[str, bytes]
    commit: str
    revisions: dict[str, str]
    is_gated: bool = False

    def resolve(self, revision: str) -> str | None:
        """The commit a branch, tag or commit names, if any."""
        return self.revisions.get(revision) or (self.commit if revision == self.commit else None)


@dataclass
class Seen:
    """One request the stub answered."""

    method: str
    path: str
    range: str | None
    has_auth: bool = False


@dataclass
class Cut:
    """Cut `name`'s next GET after `after_bytes`; then serve it, or fail (500) until healed."""

    name: str
    after_bytes: int
    then_fail: bool
    is_stall: bool = False  # hold the connection open (bytes stop coming) until healed, then cut
    has_cut: bool = False


@dataclass
class HubStub:
    """The stub's state, shared with the handler threads."""

    repos: dict[str, StubRepo] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    cut: Cut | None = None
    url: str = ""
    cdn_url: str = ""  # `url` under another host name: another origin, as a CDN is
    ignores_range: bool = False  # answer a Range request 200, with the whole file
    uses_cdn: bool = False  # redirect `*.safetensors` to `cdn_url`
    lock: threading.Lock = field(default_factory=threading.Lock)
    stalled: threading.Event = field(default_factory=threading.Event)
    healed: threading.Event = field(default_factory=threading.Event)
    token: str | None = None  # pushes: the only token it takes
    pushed: dict[str, dict[str, bytes]] = field(default_factory=dict)  # "model:owner/name" -> files
    created: list[dict[str, Any]] = field(default_factory=list)  # repo creation bodies
    auth_seen: list[str] = field(default_factory=list)  # Authorization headers of pushes

    def add_repo(self, repo: str, files: dict[str, bytes], *, gated: bool = False,
                 revisions: tuple[str, ...] = ("main",)) -> str:
        """Serve `files` as `repo`; its commit hash."""
        commit = hashlib.sha1(repr((repo, sorted(files.items()))).encode()).hexdigest()
        self.repos[repo] = StubRepo(files, commit, dict.fromkeys(revisions, commit), gated)
        return commit

    def add_dir(self, repo: str, path: Path, **extra: Any) -> str:
        """Serve the files of a model dir (and nothing under its subdirs) as `repo`."""
        return self.add_repo(repo, {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()}, **extra)

    def cut_after(self, name: str, after_bytes: int, *, then_fail: bool = False) -> None:
        """Drop the connection of the next GET of file `name` after `after_bytes` bytes; with
        `then_fail`, answer its later GETs 500 (the hub is down) until `heal()`."""
        self.cut = Cut(name, after_bytes, then_fail)

    def stall_after(self, name: str, after_bytes: int) -> None:
        """Stop sending the next GET of file `name` after `after_bytes` bytes, until `heal()`;
        `stalled` is set once it does."""
        self.cut = Cut(name, after_bytes, then_fail=False, is_stall=True)

    def heal(self) -> None:
        """Serve every file whole again, from the hub, Range requests as asked (and let a stalled download end)."""
        self.cut = None
        self.ignores_range = self.uses_cdn = False
        self.healed.set()

    def ranges(self, name: str) -> list[str]:
        """The Range headers of the GETs of file `name` so far."""
        with self.lock:
            return [s.range for s in self.seen if s.method == "GET" and s.path.endswith("/" + name) and s.range]

    def find_blob(self, sha256: str) -> bytes | None:
        """The file with this sha256, in any repo."""
        found = (d for r in self.repos.values() for d in r.files.values() if hashlib.sha256(d).hexdigest() == sha256)
        return next(found, None)

    def find_repo(self, path: str) -> tuple[str, str] | None:
        """The known repo `path` starts with, and what follows it."""
        for repo in sorted(self.repos, key=len, reverse=True):
            if path == repo or path.startswith(repo + "/"):
                return repo, path[len(repo) + 1:]
        return None


class Handler(BaseHTTPRequestHandler):
    """Routes a request to the API or the file endpoints."""

    protocol_version = "HTTP/1.1"
    server: StubServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows what the tests assert

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        hub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        with hub.lock:
            hub.seen.append(Seen("POST", path, None, bool(auth)))
            hub.auth_seen.append(auth)
        if hub.token is not None and auth != f"Bearer {hub.token}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return
        if path == "/api/repos/create":
            spec = json.loads(body)
            hub.created.append(spec)
            repo = f"{spec.get('organization') or 'me'}/{spec['name']}"
            prefix = "datasets/" if spec.get("type") == "dataset" else ""
            key = f"{spec.get('type') or 'model'}:{repo}"
            if key in hub.pushed:
                self._error(409, None, "You already created this repo")
                return
            hub.pushed[key] = {}
            self._json({"url": f"{hub.url}/{prefix}{repo}"})
            return
        match = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
        if match is None:
            self._error(404, None, "no such route")
            return
        kind, repo, action, _ = match.groups()
        key = f"{kind[:-1]}:{repo}"
        if key not in hub.pushed:
            self._error(404, "RepoNotFound", "Repository not found")
        elif action == "preupload":
            files = json.loads(body)["files"]
            self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        else:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    hub.pushed[key][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            oid = hashlib.sha1(body).hexdigest()
            self._json({"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})

    def _route(self, method: str) -> None:
        hub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.seen.append(Seen(method, path, self.headers.get("Range"), "Authorization" in self.headers))
        if path.startswith("/cdn/"):  # /cdn/<sha256>/<name>
            self._cdn(method, *path.removeprefix("/cdn/").split("/", 1))
        elif path.startswith("/api/models/"):
            self._api(path.removeprefix("/api/models/"))
        elif (found := hub.find_repo(path.lstrip("/"))) and found[1].startswith("resolve/"):
            self._file(method, found[0], found[1].removeprefix("resolve/"))
        else:
            self._error(404, "RepoNotFound", "Repository not found")

    def _api(self, rest: str) -> None:
        found = self.server.hub.find_repo(rest)
        if found is None:
            self._error(401, "RepoNotFound", "Invalid username or password.")  # what the hub says to anyone
            return
        repo_id, tail = found
        repo = self.server.hub.repos[repo_id]
        kind, _, revision = tail.partition("/")
        revision = revision.split("/", 1)[0] if kind == "tree" else revision or "main"
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        elif kind == "tree":
            self._json([{"type": "file", "oid": _blob_id(d), "size": len(d), "path": n} for n, d in repo.files.items()])
        else:
            siblings = [{"rfilename": n, "size": len(d), "blobId": _blob_id(d)} for n, d in repo.files.items()]
            self._json({"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "gated": "manual" if repo.is_gated else False, "disabled": False, "siblings": siblings})

    def _file(self, method: str, repo_id: str, rest: str) -> None:
        repo = self.server.hub.repos[repo_id]
        revision, _, name = rest.partition("/")
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        elif repo.is_gated:
            self._error(401, "GatedRepo", "Access to model is restricted")
        elif name not in repo.files:
            self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
        elif self.server.hub.uses_cdn and name.endswith(".safetensors"):
            self._redirect_to_cdn(commit, name, repo.files[name])
        else:
            self._send_file(method, commit, name, repo.files[name])

    def _redirect_to_cdn(self, commit: str, name: str, data: bytes) -> None:
        """The hub's answer for an LFS file: its metadata, and where to get it."""
        sha256 = hashlib.sha256(data).hexdigest()
        self.send_response(302)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Linked-Etag", f'"{sha256}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Location", f"{self.server.hub.cdn_url}/cdn/{sha256}/{name}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _cdn(self, method: str, sha256: str, name: str) -> None:
        data = self.server.hub.find_blob(sha256)
        if data is None:
            self._error(404, None, "no such blob")
        else:
            self._send_file(method, "", name, data)

    def _send_file(self, method: str, commit: str, name: str, data: bytes) -> None:
        cut = self.server.hub.cut
        if cut is not None and (cut.name != name or method != "GET" or cut.has_cut):
            if cut.name == name and method == "GET" and cut.then_fail:
                self._error(500, None, "hub down")
                return
            cut = None
        start = 0 if self.server.hub.ignores_range else _range_start(self.headers.get("Range"), len(data))
        self.send_response(206 if start else 200)
        if commit:  # the hub's own answers; a CDN's know no commit
            self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if method == "GET":
            self._write_body(data[start:], cut)

    def _write_body(self, body: bytes, cut: Cut | None) -> None:
        if cut is None:
            self.wfile.write(body)
            return
        cut.has_cut = True
        self.wfile.write(body[: cut.after_bytes])
        self.wfile.flush()
        if cut.is_stall:
            self.server.hub.stalled.set()
            self.server.hub.healed.wait(60)
        self.close_connection = True  # the rest never comes: the client sees a short body

    def _json(self, value: Any) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command in ("GET", "POST"):
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command in ("GET", "POST"):
            self.wfile.write(body)


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: HubStub) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.hub = hub


@contextmanager
def running_hub() -> Iterator[HubStub]:
    """A stub hub served on a free port in a thread; `hub.url` is its HF_ENDPOINT."""
    hub = HubStub()
    server = StubServer(hub)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    hub.cdn_url = f"http://localhost:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub-stub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _range_start(header: str | None, size: int) -> int:
    """Where a `bytes=N-` Range starts (0 without one, or for one past the end)."""
    match = RANGE_RE.match(header or "")
    start = int(match.group(1)) if match else 0
    return start if start < size else 0
