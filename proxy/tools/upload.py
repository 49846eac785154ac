"""`symgate upload FILE|DIR...`: put a site's own debug files on a symgate.

Each ELF file is known by its build-ID note and uploaded as what it can serve as (a debug file
as debuginfo, a program or library with code as executable, an unstripped one as both). The
server is asked first (HEAD, only from its cache) whether it has each one already, so running
the same command again sends nothing twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from proxy import __version__
from proxy.headers import UPLOAD_SHA256, printable
from proxy.keys import Kind
from proxy.sources.localdir import classify
from proxy.tools.answers import failure, not_from_symgate, said
from proxy.tools.prefetch import progress_bar

CHUNK = 256 * 1024
# A symgate's answer to a PUT is a line of JSON: more, or slower, is not one.
ANSWER_BYTES = 64 * 1024
ANSWER_WAIT_S = 30.0
UPLOADED, PRESENT, FAILED = "uploaded", "already there", "failed"


@dataclass(frozen=True, slots=True)
class Item:
    path: Path
    build_id: str
    kind: Kind
    size: int


@dataclass
class Summary:
    files: int = 0
    results: dict[Item, str] = field(default_factory=dict)  # UPLOADED, PRESENT, or why failed
    sent: int = 0
    skipped: list[str] = field(default_factory=list)  # given files that are not ELF with an ID

    def counts(self) -> Counter[str]:
        return Counter(r if r in (UPLOADED, PRESENT) else FAILED for r in self.results.values())


def find_items(paths: Iterable[Path], summary: Summary) -> list[Item]:
    """Every (build ID, kind) the given files and the files under the given directories can
    serve, once each, in the order found. Files given by name that cannot serve as anything
    go to summary.skipped; such files met in a directory walk are passed over."""
    items: dict[tuple[str, Kind], Item] = {}

    def add(path: Path, named: bool) -> None:
        build_id, kinds = classify(path)
        if build_id is None or not kinds:
            if named:
                summary.skipped.append(f"{path}: not an ELF file with a GNU build-ID note")
            return
        summary.files += 1
        size = path.stat().st_size
        for kind in kinds:
            items.setdefault((build_id, kind), Item(path, build_id, kind, size))

    for root in paths:
        if root.is_dir():
            for dirpath, dirs, names in os.walk(root):
                dirs.sort()
                for name in sorted(names):
                    p = Path(dirpath) / name
                    if p.is_file() and not p.is_symlink():
                        add(p, named=False)
        elif root.is_file():
            add(root, named=True)
        elif root.exists():
            # A device, a FIFO, a socket: not read (a FIFO would hold the command). It was
            # said to be missing, which sent the operator looking for a typo.
            summary.skipped.append(f"{root}: not a file or directory")
        else:
            summary.skipped.append(f"{root}: no such file or directory")
    return list(items.values())


# What an item not done when the overall timeout came is reported as.
TIMED_OUT = "timed out"


async def upload(server: str, token: str, tenant: str | None, items: list[Item],
                 concurrency: int, summary: Summary,
                 progress: Callable[[Summary, int], None], timeout_s: float) -> bool:
    """False if `timeout_s` ran out first (what was not done is then TIMED_OUT): a server
    that trickles its answers held the command for ever, one that never answers five
    minutes a request."""
    headers = {"User-Agent": f"symgate-upload/{__version__}", "Authorization": f"Bearer {token}"}
    if tenant:
        headers["X-Scope-OrgID"] = tenant
    limit = asyncio.Semaphore(concurrency)
    base = server.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:

        async def one(item: Item) -> None:
            url = f"{base}/buildid/{item.build_id}/{item.kind}"
            async with limit:
                try:
                    summary.results[item] = await _one(session, url, item, summary, progress,
                                                       len(items))
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    summary.results[item] = failure(e)
            progress(summary, len(items))

        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(one(i) for i in items))
        except TimeoutError:
            for item in items:
                summary.results.setdefault(item, TIMED_OUT)
            return False
    return True


async def _one(session: aiohttp.ClientSession, url: str, item: Item, summary: Summary,
               progress: Callable[[Summary, int], None], total: int) -> str:
    # Only from its cache: a HEAD that made it fetch from its upstreams would cost a download.
    async with session.head(url, headers={"Cache-Control": "only-if-cached"}) as r:
        if r.status == 200 and "X-DEBUGINFOD-FILE" not in r.headers:
            # Another service's 200 to anything: every file was "already there", none sent.
            return "HEAD " + not_from_symgate(r, "a debuginfod's answer")
        if r.status == 200 and r.headers.get(UPLOAD_SHA256) == await asyncio.to_thread(
                _sha256_of, item.path):
            return PRESENT
        # Any other 200 is a download of the key (the upstream's copy, evicted when the
        # cache needs room) or another upload of it: the PUT makes the site's file the upload
        # (201), or says it conflicts (409), or that it is there after all (200).
        if r.status == 401:
            # A HEAD's answer has no body to say why: what a 401 can only mean, said here.
            return ("HEAD 401: the server refused the token (none sent, or one it does not "
                    "know: SYMGATE_TOKEN or --token-file)")
        if r.status == 400:
            return "HEAD 400: the server refused the request"

    async def body() -> AsyncIterator[bytes]:
        with item.path.open("rb") as f:
            while chunk := f.read(CHUNK):
                summary.sent += len(chunk)
                progress(summary, total)
                yield chunk

    # Not redirected: the file is sent once, and the token only where it was meant to go.
    async with session.put(url, data=body(), allow_redirects=False, headers={
            "Content-Length": str(item.size), "Content-Type": "application/octet-stream",
            **_file_name(item.path.name)}) as r:
        if r.status not in (200, 201):
            # Whatever answered: not always a symgate, nor text, nor of an end.
            return f"{r.status}{await said(r)}"
        if not await _from_symgate(r, item):
            return not_from_symgate(r, "a symgate's upload answer")
        # 200: the very same file was there
        return UPLOADED if r.status == 201 else PRESENT


async def _from_symgate(r: aiohttp.ClientResponse, item: Item) -> bool:
    """Whether a 200 or 201 is a symgate's account of this upload (proxy/web/upload.py)."""
    try:
        async with asyncio.timeout(ANSWER_WAIT_S):
            answer = json.loads(await r.content.read(ANSWER_BYTES))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return False
    return isinstance(answer, dict) and answer.get("build_id") == item.build_id


def _sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_name(name: str) -> dict[str, str]:
    """X-DEBUGINFOD-FILE, for a name a header can carry. One with a line break, or with bytes
    that are not UTF-8 (os.fsdecode's surrogates), made aiohttp refuse the request, and the
    whole upload end in a traceback: such a file goes without it (the default name)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return {}
    return {"X-DEBUGINFOD-FILE": name} if printable(name, 4096) else {}


def terminal_progress(summary: Summary, total: int) -> None:
    c = summary.counts()
    progress_bar(len(summary.results), total, f"uploaded={c[UPLOADED]} there={c[PRESENT]} "
                 f"failed={c[FAILED]}  {summary.sent / 1e6:.1f} MB sent")


def report(summary: Summary) -> str:
    c = summary.counts()
    lines = [f"{len(summary.results)} artifacts from {summary.files} files: {c[UPLOADED]} "
             f"uploaded, {c[PRESENT]} already there, {c[FAILED]} failed; "
             f"{summary.sent} bytes sent"]
    lines += [f"  {i.build_id} {i.kind} ({i.path}): {why}"
              for i, why in summary.results.items() if why not in (UPLOADED, PRESENT)]
    lines += [f"  skipped {s}" for s in summary.skipped]
    return "\n".join(lines) + "\n"
