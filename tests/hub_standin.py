"""A loopback stand-in for the parts of the Hub's HTTP API that uploads use (olah, the read-only mirror, has none).

It speaks what ``huggingface_hub`` sends and reads: ``whoami-v2``, repo info, ``repos/create``, ``validate-yaml``,
``preupload`` (every
file ``regular``, so contents travel inline), ``commit`` (NDJSON), and ``resolve`` for downloads, with
``X-Repo-Commit`` and ``ETag``. Faults can be switched on: a wrong token gets 401, and ``drop_commit`` closes the
connection in the middle of a commit, as a server going down would.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

TOKEN = "hf_standin_token"


class HubState:
    def __init__(self) -> None:
        self.repos: dict[str, list[tuple[str, dict[str, bytes]]]] = {}  # repo id -> commits (sha, files), oldest first
        self.drop_commit = False
        self.lock = threading.Lock()

    def head(self, repo_id: str) -> tuple[str, dict[str, bytes]]:
        return self.repos[repo_id][-1]

    def files_at(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        for sha, files in reversed(self.repos.get(repo_id, [])):
            if revision in ("main", sha):
                return sha, files
        return None


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def _send(self, status: int, body: object = None, headers: dict | None = None, raw: bytes | None = None):
            data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _authorised(self) -> bool:
            if self.headers.get("authorization") == f"Bearer {TOKEN}":
                return True
            self._send(401, {"error": "Invalid credentials"}, {"X-Error-Code": "InvalidCredentials"})
            return False

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("content-length", 0)))

        def _not_found(self, what: str = "RepoNotFound") -> None:
            self._send(404, {"error": what}, {"X-Error-Code": what, "X-Error-Message": what})

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = unquote(urlparse(self.path).path)
            parts = path.strip("/").split("/")
            if path == "/api/whoami-v2":
                if self._authorised():
                    self._send(200, {"type": "user", "name": "tester", "auth": {"type": "access_token"}})
            elif parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":  # recursive listing
                found = state.files_at("/".join(parts[2:4]), parts[5])
                if found is None:
                    return self._not_found()
                entries = [
                    {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in sorted(found[1].items())
                ]
                self._send(200, entries)
            elif parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                found = state.files_at(repo_id, parts[5] if len(parts) > 5 else "main")
                if found is None:
                    return self._not_found()
                sha, files = found
                self._send(200, {"id": repo_id, "sha": sha, "siblings": [{"rfilename": f} for f in sorted(files)]})
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                found = state.files_at(repo_id, revision)
                if found is None:
                    return self._not_found()
                sha, files = found
                if file not in files:
                    return self._not_found("EntryNotFound")
                etag = hashlib.sha1(files[file]).hexdigest()
                self._send(200, raw=files[file], headers={"X-Repo-Commit": sha, "ETag": f'"{etag}"'})
            else:
                self._not_found()

        def do_POST(self) -> None:
            path = unquote(urlparse(self.path).path)
            parts = path.strip("/").split("/")
            if not self._authorised():
                return
            body = self._body()
            if path == "/api/validate-yaml":  # the model card's metadata, checked before a commit
                self._send(200, {"errors": [], "warnings": []})
            elif path == "/api/repos/create":
                req = json.loads(body)
                repo_id = f"{req.get('organization') or 'tester'}/{req['name']}"
                with state.lock:
                    if repo_id in state.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": repo_id})
                    state.repos[repo_id] = [(hashlib.sha1(repo_id.encode()).hexdigest(), {".gitattributes": b""})]
                self._send(200, {"url": f"http://{self.headers['host']}/{repo_id}", "name": repo_id})
            elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                repo_id = "/".join(parts[2:4])
                if repo_id not in state.repos:
                    return self._not_found()
                files = [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                    for f in json.loads(body)["files"]
                ]
                self._send(200, {"files": files, "commitOid": state.head(repo_id)[0]})
            elif len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                repo_id = "/".join(parts[2:4])
                if repo_id not in state.repos:
                    return self._not_found()
                if state.drop_commit:  # the server goes down mid-upload: no answer, no commit
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                files = dict(state.head(repo_id)[1])
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] == "deletedFile":
                        files.pop(item["value"]["path"], None)
                    elif item["key"] != "header":
                        return self._send(400, {"error": f"unsupported commit entry {item['key']}"})
                sha = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
                with state.lock:
                    state.repos[repo_id].append((sha, files))
                url = f"http://{self.headers['host']}/{repo_id}/commit/{sha}"
                self._send(200, {"commitUrl": url, "commitOid": sha, "success": True, "pullRequestUrl": None})
            else:
                self._not_found()

    return Handler


def start() -> tuple[ThreadingHTTPServer, HubState, str]:
    """Serve on a free loopback port in a daemon thread; returns the server, its state and its endpoint URL."""
    state = HubState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state, f"http://127.0.0.1:{server.server_address[1]}"
