"""The routing guidance of deploy/: the Kubernetes manifests validate against the API's schemas,
nginx accepts the shipped config, and, live, real nginx with that config in front of three real
`symgate serve` replicas (one PostgreSQL, a data dir each, the real elfutils debuginfod
upstream) sends each build ID to one replica, fetches it upstream once, and moves a killed
replica's slice to the others."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import load_config
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.front import SERVER_LINE, SHIPPED, front_config, nginx_binary
from tests.harness import (
    Debuginfod,
    changes,
    eventually,
    free_port,
    serve_loopback,
    served,
    upstream_requests,
)
from tests.processes import (
    alive,
    descendants,
    run_in_thread,
    start_serve,
    stop_serve,
    wait_until_serving,
)

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# A version whose schemas kubernetes-validate ships (it validates offline, from its own copy).
K8S_VERSION = "1.33.0"
NGINX = nginx_binary()
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed "
                                 "(apt-get install nginx-light)")


def manifests() -> list[tuple[str, dict[str, Any]]]:
    import yaml

    found = [(f"{path.name}: {doc['kind']} {doc['metadata']['name']}", doc)
             for path in sorted(K8S.glob("*.yaml"))
             for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert found, f"no manifests under {K8S}"
    return found


def manifest(kind: str, name: str) -> dict[str, Any]:
    return next(doc for _, doc in manifests()
                if doc["kind"] == kind and doc["metadata"]["name"] == name)


@pytest.mark.parametrize("name,doc", manifests(), ids=[n for n, _ in manifests()])
def test_manifest_validates_against_the_kubernetes_schemas(name: str, doc: dict[str, Any]
                                                           ) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    # strict: a misspelt field (readinesProbe) is an error, not silently ignored.
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifests_give_three_ready_probed_replicas_their_config_and_secrets() -> None:
    sts = manifest("StatefulSet", "symgate")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert sts["spec"]["replicas"] == 3
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {e["secretRef"]["name"] for e in container["envFrom"]} == {"symgate"}
    config = load_config(None, environ={})  # what the server takes when nothing is set
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > config.server.shutdown_grace_s
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["data"] and mounts["data"] == "/data"
    assert volumes["config"]["configMap"]["name"] == "symgate-config"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SYMGATE_CONFIG"] == f"{mounts['config']}/config.toml"
    assert manifest("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_configmap_config_is_what_symgate_reads_with_the_secret_in_its_environment(
    tmp_path: Path,
) -> None:
    """The ConfigMap's config.toml through symgate's own loader, with the Secret's variables as
    the pod gets them: the database URL comes from the environment, [storage] has the
    names the docs use, and no credential sits in the ConfigMap."""
    text = manifest("ConfigMap", "symgate-config")["data"]["config.toml"]
    secret = manifest("Secret", "symgate")["stringData"]
    assert set(secret) >= {"SYMGATE_DATABASE_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    path = tmp_path / "config.toml"
    path.write_text(text)
    config = load_config(path, environ=secret)
    assert config.database_url == secret["SYMGATE_DATABASE_URL"]
    assert config.storage is not None
    assert set(tomllib.loads(text)["storage"]) == {"url", "endpoint", "region"}
    assert config.storage.url == "s3://symgate-cache/prefix"
    for value in secret.values():
        assert value not in text


def test_k8s_nginx_config_is_the_shipped_one_but_for_its_servers() -> None:
    """The nginx in Kubernetes hashes and proxies exactly as deploy/nginx/symgate.conf does: only
    its upstream's server lines (the replicas' DNS names, resolved as pods move) and the
    resolver they need differ."""
    k8s = manifest("ConfigMap", "symgate-nginx")["data"]["symgate.conf"]
    servers = SERVER_LINE.findall(k8s)
    assert [addr for _, addr, _ in servers] == [
        f"symgate-{i}.symgate-replicas.symgate.svc.cluster.local:8002" for i in range(3)]
    shipped = SHIPPED.read_text()
    # Their parameters are the shipped lines' (max_fails, fail_timeout), plus resolve.
    shipped_params = {params for _, _, params in SERVER_LINE.findall(shipped)}
    assert {params.replace(" resolve", "") for _, _, params in servers} == shipped_params
    assert all(" resolve" in params for _, _, params in servers)
    resolver = re.compile(r"^resolver [^\n]*;\n\n", re.M)
    assert len(resolver.findall(k8s)) == 1
    assert SERVER_LINE.sub("", resolver.sub("", k8s)) == SERVER_LINE.sub("", shipped)


@needs_nginx
async def test_nginx_accepts_the_shipped_config(tmp_path: Path) -> None:
    replicas = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    conf = front_config(tmp_path, free_port(), replicas)
    text = (tmp_path / "symgate.conf").read_text()
    assert "hash $symgate_key consistent;" in text
    assert [addr for _, addr, _ in SERVER_LINE.findall(text)] == replicas
    done = await run_in_thread([str(NGINX), "-t", "-p", str(tmp_path), "-c", str(conf)])
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------------------------
# Live: nginx in front of three replicas


@dataclass
class Front:
    url: str
    replicas: list[str]  # base URLs, in the order of the upstream's server lines
    procs: list[asyncio.subprocess.Process]
    logs: Path


@contextlib.asynccontextmanager
async def nginx_in_front(tmp_path: Path, database_url: str, upstream: str
                         ) -> AsyncIterator[Front]:
    """Three `symgate serve` replicas of `upstream` on one database, nginx with the shipped
    config in front of them; all stopped at the end."""
    procs: list[asyncio.subprocess.Process] = []
    nginx: asyncio.subprocess.Process | None = None
    try:
        # All three at once on the new database: each migrates in turn (an advisory lock).
        started = await asyncio.gather(*(
            start_serve(tmp_path, tmp_path / f"r{i}", database_url, upstream,
                        extra="access_flush_s = 0.2\n") for i in range(3)))
        procs += [p for _, p in started]
        bases = [b for b, _ in started]
        port = free_port()
        prefix = tmp_path / "nginx"
        conf = front_config(prefix, port, [b.removeprefix("http://") for b in bases])
        nginx = await asyncio.create_subprocess_exec(
            str(NGINX), "-p", str(prefix), "-c", str(conf), stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        await wait_until_serving(url, nginx, prefix / "logs" / "error.log")
        yield Front(url, bases, procs, prefix / "logs")
    finally:
        if nginx is not None and nginx.returncode is None:
            nginx.send_signal(signal.SIGQUIT)  # graceful: workers finish, then the master exits
            try:
                await asyncio.wait_for(nginx.wait(), 10)
            except TimeoutError:
                nginx.kill()
                await nginx.wait()
        await stop_serve(procs)


@pytest.fixture
async def front(tmp_path: Path, database_url: str, debuginfod: Debuginfod
                ) -> AsyncIterator[Front]:
    async with nginx_in_front(tmp_path, database_url, debuginfod.url) as running:
        yield running


async def fetch(session: aiohttp.ClientSession, url: str, method: str = "GET"
                ) -> tuple[int, bytes, dict[str, str]]:
    async with session.request(method, url) as r:
        return r.status, await r.read(), dict(r.headers)


GETS = 4  # per build ID through nginx: one miss, then hits


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@needs_nginx
async def test_nginx_sends_each_build_id_to_one_replica_and_moves_a_dead_ones_slice(
    front: Front, elfs: ElfSet, debuginfod: Debuginfod
) -> None:
    owner: dict[str, str] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for elf in elfs.all:
            body = elf.debug.read_bytes()
            before = {b: await served(b) for b in front.replicas}
            upstream_before = await upstream_requests(debuginfod)
            url = f"{front.url}/buildid/{elf.build_id}/debuginfo"
            for _ in range(GETS):
                status, got, _ = await fetch(s, url)
                assert (status, got == body) == (200, True), elf.name
            status, got, headers = await fetch(s, url, "HEAD")  # passed through, not a GET
            assert (status, got, int(headers["Content-Length"])) == (200, b"", len(body))

            async def counted(b: dict[str, dict[str, float]] = before) -> bool:
                moved = {r: changes(b[r], await served(r)) for r in front.replicas}
                return sum(sum(c.values()) for c in moved.values()) == GETS + 1

            await eventually(counted, timeout=10)  # counted once each response is done
            moved = {r: changes(before[r], await served(r)) for r in front.replicas}
            (replica,) = [r for r, c in moved.items() if c]
            # One replica had every request for this ID: its one miss, then hits only.
            assert moved[replica] == {"miss": 1, "hit": GETS}, (elf.name, moved)
            assert await upstream_requests(debuginfod) == upstream_before + 1, elf.name
            owner[elf.build_id] = replica

        # Other keys spread over all three replicas (each key still to one): 48 build IDs no
        # upstream has, their 404s counted on the replica that answered them.
        before = {b: await served(b) for b in front.replicas}
        missing = [f"{i:02x}" * 20 for i in range(48)]
        for build_id in missing:
            assert (await fetch(s, f"{front.url}/buildid/{build_id}/debuginfo"))[0] == 404
        after = {b: await served(b) for b in front.replicas}
        answered = {r: changes(before[r], after[r]).get("not_found", 0) for r in front.replicas}
        assert sum(answered.values()) == len(missing) and all(answered.values()), answered

        # SIGKILL the replica with the most of the real IDs: its processes vanish at once
        # (no drain), nginx finds its connections refused and its slice goes on round the ring.
        victim = max(front.replicas, key=lambda r: sum(o == r for o in owner.values()))
        proc = front.procs[front.replicas.index(victim)]
        tree = {proc.pid, *descendants(proc.pid)}
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

        async def gone() -> bool:
            return not any(alive(pid) for pid in tree)

        await eventually(gone, timeout=10)
        moved_ids = [i for i, o in owner.items() if o == victim]
        upstream_before = await upstream_requests(debuginfod)
        for elf in elfs.all:
            body = elf.debug.read_bytes()
            for _ in range(3):
                status, got, _ = await fetch(s, f"{front.url}/buildid/{elf.build_id}/debuginfo")
                assert (status, got == body) == (200, True), (elf.name, status)
        # The survivors kept their own slices (hits), and each moved ID was fetched once more
        # by the one replica it moved to.
        assert await upstream_requests(debuginfod) == upstream_before + len(moved_ids)
    access = (front.logs / "access.log").read_text()
    assert f"replica={victim.removeprefix('http://')}" in access


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@needs_nginx
async def test_a_replicas_502_for_its_upstreams_failure_is_not_retried_on_the_others(
    tmp_path: Path, database_url: str, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """symgate answers 502 when its upstream fails (and 504 when it times out): every replica
    would fail alike, each with its own upstream round trips, so nginx passes the answer on
    (proxy_next_upstream has error, timeout and http_503 only) and counts no failure against a
    replica that is fine."""
    upstream = faults.url_for("status500")
    async with nginx_in_front(tmp_path, database_url, upstream) as front, \
            aiohttp.ClientSession() as s:
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        asked = faults.count("status500")
        assert (await fetch(s, front.replicas[0] + path))[0] == 502
        one_replica = faults.count("status500") - asked  # its tries, retries included
        for _ in range(3):
            asked = faults.count("status500")
            assert (await fetch(s, front.url + path))[0] == 502
            assert faults.count("status500") - asked == one_replica


class HeldUnsized:
    """An upstream that sends the big fixture's debuginfo without saying its size (chunked):
    half of it, then `half` is set, then the rest once `release` is."""

    def __init__(self, elfs: ElfSet) -> None:
        self.elf = elfs.big
        self.half = asyncio.Event()
        self.release = asyncio.Event()
        self.asked = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["build_id"] != self.elf.build_id:
            return web.Response(status=404)
        self.asked += 1
        data = self.elf.debug.read_bytes()
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        self.half.set()
        await self.release.wait()
        await response.write(data[len(data) // 2:])
        await response.write_eof()
        return response


async def http10_get(url: str, path: str) -> tuple[bytes, bytes]:
    """GET in HTTP/1.0, read until the server closes: (head, body)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        got = await reader.read()  # to EOF: what an HTTP/1.0 client takes for the end
    finally:
        writer.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@needs_nginx
async def test_an_http10_client_never_takes_a_killed_replicas_cut_body_for_a_whole_file(
    tmp_path: Path, database_url: str, elfs: ElfSet
) -> None:
    """A cold file whose upstream said no size, asked in HTTP/1.0 through nginx, and the replica
    fetching it SIGKILLed mid-download. An HTTP/1.0 client has no chunked encoding: a body
    without a Content-Length ends where the connection does. symgate sends it such a file
    once whole, with its length; nginx must not ask in HTTP/1.1 and hand the client the
    chunks it got before the kill as a 200 that ends cleanly (half the file, looking whole).
    The kill came before any byte was sent, so nginx retries the next replica, which fetches
    the file again and sends it whole."""
    upstream = HeldUnsized(elfs)
    app = web.Application()
    app.router.add_get("/buildid/{build_id}/{kind}", upstream.handle)
    runner, url = await serve_loopback(app)
    body = elfs.big.debug.read_bytes()
    try:
        async with nginx_in_front(tmp_path, database_url, url) as front:
            client = asyncio.create_task(
                http10_get(front.url, f"/buildid/{elfs.big.build_id}/debuginfo"))
            await upstream.half.wait()

            def fetching() -> list[int]:  # the replica holding the download's flight
                return [i for i in range(len(front.procs))
                        if any((tmp_path / f"r{i}" / "cache" / "flights").glob("*.json"))]

            await eventually(lambda: len(fetching()) == 1)
            (owner,) = fetching()
            front.procs[owner].send_signal(signal.SIGKILL)
            await front.procs[owner].wait()
            upstream.release.set()
            head, got = await asyncio.wait_for(client, 60)
            lines = head.decode("latin-1").split("\r\n")
            fields = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
            assert lines[0].split()[1] == "200", lines[0]
            assert fields.get("content-length") == str(len(body)), (lines, len(got))
            assert got == body
            assert upstream.asked == 2  # the killed replica's fetch, then the next one's
    finally:
        await runner.cleanup()
