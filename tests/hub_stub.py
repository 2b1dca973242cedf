"""A local stand-in for the few Hugging Face Hub endpoints that pushing and loading a model touch.

It lets the tests exercise `huggingface_hub`'s real client code (create_repo, upload_folder, hf_hub_download as
called by `from_pretrained`) without the network. Only what huggingface_hub 2.x actually calls is answered:

    POST /api/repos/create                          create_repo
    POST /api/validate-yaml                         create_commit checks README.md front matter first
    POST /api/models/{repo}/preupload/{rev}         answered "regular" for every file, so the content travels
                                                    inline (base64) in the commit and no LFS/Xet server is needed
    POST /api/models/{repo}/commit/{rev}            the ndjson commit: header line, then one line per file added
                                                    (inline) or deleted
    GET  /api/models/{repo}[/revision/{rev}]        repo_info, used to resolve a revision to a commit sha
    GET  /api/models/{repo}/tree/{rev}[/{folder}]   list_repo_tree: transformers' tokenizer loading lists the
                                                    repo root and looks for an additional_chat_templates/ folder
    HEAD /{repo}/resolve/{rev}/{path}               file metadata: ETag, X-Repo-Commit, Content-Length
    GET  /{repo}/resolve/{rev}/{path}               file content

`GET /api/agent-harnesses` (a best-effort client telemetry lookup, whose failure the client ignores) answers 404 on
purpose: serving it would make the client cache the answer under the real HF_HOME. Anything else answers 404 and is
recorded in `unhandled`, so a test can tell an endpoint it forgot from a file that is really missing.

Clients must run with Xet disabled (`HF_HUB_DISABLE_XET=1`, or `huggingface_hub.constants.HF_HUB_DISABLE_XET`
patched): with hf_xet installed, upload_folder otherwise takes the Xet upload path, which needs a
content-addressed storage server that this stand-in does not imitate. Checked against huggingface_hub 2.4.

Two faults can be asked for, on commit requests (the one request that changes a repository): `cut_commits=N` drops
the connection of the next N half-way through their bodies, as a network that fails mid-upload; `stall_commits=True`
sets `commit_arriving` once the body of each starts arriving and reads it only once `release` is set, so that a test
can kill the client while its upload is in flight (a body larger than the sockets' buffers is then cut short). A commit whose body does not arrive whole changes
nothing, as on the Hub, and is counted in `incomplete_commits`.

The server binds 127.0.0.1 on a free port and shuts itself down after `lifetime_s` even if a test forgets to.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_IGNORED = {("GET", "/api/agent-harnesses")}
_ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "_create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "_validate_yaml"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "_preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "_commit"),
    ("GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$"), "_repo_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<folder>.+))?$"), "_tree"),
    ("HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "_resolve"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "_resolve"),
]


def _git_blob_sha(content: bytes) -> str:
    # The Hub's ETag for a non-LFS file is its git blob id; hf_hub_download caches blobs under that name.
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubStub:
    """Run the stand-in server for the duration of a `with` block; `endpoint` is what HF_ENDPOINT should be."""

    def __init__(self, lifetime_s: float = 120.0, cut_commits: int = 0, stall_commits: bool = False):
        self.lifetime_s = lifetime_s
        self.cut_commits = cut_commits
        self.stall_commits = stall_commits
        self.commit_arriving = threading.Event()
        self.release = threading.Event()
        self.incomplete_commits = 0
        self.preuploads: list[list[str]] = []  # the paths each preupload request asked about
        # repo_id -> {"private": bool, "files": {path: bytes}, "sha": commit sha or None before the first commit}
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []  # one entry per commit: repo, revision, summary, paths
        self.unhandled: list[str] = []
        self.authorizations: set[str] = set()  # every Authorization header seen, to check the token was sent
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubStub:
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._deadline = threading.Timer(self.lifetime_s, self._server.shutdown)
        self._deadline.daemon = True
        self._deadline.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._deadline.cancel()
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str) -> dict[str, bytes]:
        return self.repos[repo_id]["files"]

    # --- endpoint implementations: each returns (status, headers, body bytes) -------------------------------------

    def _create_repo(self, request: dict) -> tuple:
        payload = json.loads(request["body"])
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        with self._lock:
            if repo_id in self.repos:
                # The Hub names the existing repository, which create_repo(exist_ok=True) returns.
                return _json(409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"})
            self.repos[repo_id] = {"private": payload.get("visibility") == "private", "files": {}, "sha": None}
        return _json(200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def _validate_yaml(self, request: dict) -> tuple:
        return _json(200, {"errors": [], "warnings": []})

    def _preupload(self, request: dict, repo: str, rev: str) -> tuple:
        if repo not in self.repos:
            return _repo_not_found()
        files = json.loads(request["body"])["files"]
        self.preuploads.append([f["path"] for f in files])
        stored = self.repos[repo]["files"]
        # As the Hub does, the blob id of a file the repository already holds, from which the client tells the files
        # it need not send again.
        return _json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                      **({"oid": _git_blob_sha(stored[f["path"]])} if f["path"] in stored else {})}
                                     for f in files]})

    def _commit(self, request: dict, repo: str, rev: str) -> tuple:
        if repo not in self.repos:
            return _repo_not_found()
        lines = [json.loads(line) for line in request["body"].splitlines() if line.strip()]
        header, operations = lines[0], lines[1:]
        added, deleted = {}, []
        for operation in operations:
            if operation["key"] == "deletedFile":
                deleted.append(operation["value"]["path"])
                continue
            # Anything but inline files would mean the client skipped "regular" mode and needs LFS/Xet: fail loudly.
            if operation["key"] != "file" or operation["value"].get("encoding") != "base64":
                return _json(400, {"error": f"stand-in only accepts inline base64 files, got {operation['key']}"})
            added[operation["value"]["path"]] = base64.b64decode(operation["value"]["content"])
        with self._lock:
            state = self.repos[repo]
            for path in deleted:
                state["files"].pop(path, None)
            state["files"].update(added)
            digest = hashlib.sha1(repr(sorted((p, _git_blob_sha(c)) for p, c in state["files"].items())).encode())
            state["sha"] = digest.hexdigest()
            self.commits.append({"repo": repo, "revision": unquote(rev), "summary": header["value"]["summary"],
                                 "paths": sorted(added), "deleted": sorted(deleted)})
        return _json(200, {"commitUrl": f"{self.endpoint}/{repo}/commit/{state['sha']}",
                           "commitOid": state["sha"], "success": True})

    def _repo_info(self, request: dict, repo: str, rev: str | None) -> tuple:
        state = self.repos.get(repo)
        if state is None or state["sha"] is None:
            return _repo_not_found()
        return _json(200, {"id": repo, "modelId": repo, "sha": state["sha"], "private": state["private"],
                           "siblings": [{"rfilename": path} for path in sorted(state["files"])]})

    def _tree(self, request: dict, repo: str, rev: str, folder: str | None) -> tuple:
        state = self.repos.get(repo)
        if state is None:
            return _repo_not_found()
        # A repository just created lists empty here (the Hub's lists the .gitattributes of its first commit).
        prefix = f"{unquote(folder).strip('/')}/" if folder else ""
        recursive = request["query"].get("recursive", ["false"])[0].lower() == "true"
        entries, folders = [], set()
        for path, content in sorted(state["files"].items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            # Folders between `folder` and the file: all of them when recursive, else only the first, and the file
            # itself only if it is directly inside or the listing is recursive.
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "path": path, "oid": _git_blob_sha(content), "size": len(content)})
        if prefix and not entries and not folders:
            return 404, {"X-Error-Code": "EntryNotFound"}, b"Entry not found"
        directories = [{"type": "directory", "path": path, "oid": "0" * 40} for path in sorted(folders)]
        return _json(200, directories + entries)

    def _resolve(self, request: dict, repo: str, rev: str, path: str) -> tuple:
        state = self.repos.get(repo)
        if state is None or state["sha"] is None:
            return _repo_not_found()
        if unquote(rev) not in ("main", state["sha"]):
            return 404, {"X-Error-Code": "RevisionNotFound"}, b"Revision not found"
        content = state["files"].get(unquote(path))
        if content is None:
            # transformers probes optional files (generation_config.json, ...): this code makes that a clean miss.
            return 404, {"X-Error-Code": "EntryNotFound"}, b"Entry not found"
        headers = {"ETag": f'"{_git_blob_sha(content)}"', "X-Repo-Commit": state["sha"],
                   "Content-Type": "application/octet-stream"}
        return 200, headers, content

    def _interrupt_commit(self, handler: BaseHTTPRequestHandler, length: int) -> bool:
        """Apply the fault asked for to a commit request; True where it ended the request (the connection dropped)."""
        with self._lock:
            cut = self.cut_commits > 0
            self.cut_commits -= cut
        if cut:
            handler.rfile.read(length // 2)
            self.incomplete_commits += 1
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return True
        if self.stall_commits:
            handler.rfile.peek(1)
            self.commit_arriving.set()
            self.release.wait(self.lifetime_s)
        return False

    def _handler_class(self) -> type:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _dispatch(self) -> None:
                url = urlsplit(self.path)
                path = url.path
                length = int(self.headers.get("Content-Length") or 0)
                if self.command == "POST" and "/commit/" in path and stub._interrupt_commit(self, length):
                    return
                body = self.rfile.read(length) if length else b""
                if len(body) < length:  # the client went away mid-request: nothing to answer, nothing changes
                    stub.incomplete_commits += "/commit/" in path
                    self.close_connection = True
                    return
                request = {"body": body, "query": parse_qs(url.query)}
                if self.headers.get("Authorization"):
                    stub.authorizations.add(self.headers["Authorization"])
                for method, pattern, name in _ROUTES:
                    match = pattern.match(path)
                    if method == self.command and match:
                        status, headers, body = getattr(stub, name)(request, **match.groupdict())
                        break
                else:
                    if (self.command, path) not in _IGNORED:
                        stub.unhandled.append(f"{self.command} {self.path}")
                    status, headers, body = 404, {}, b"not implemented by the stand-in"
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

        return Handler


def _json(status: int, payload: dict | list) -> tuple:
    return status, {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _repo_not_found() -> tuple:
    return 404, {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, b'{"error": "Repository not found"}'
