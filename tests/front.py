"""nginx in front of symgate replicas on loopback, with the shipped deploy/nginx/symgate.conf:
only the replicas' addresses, the port and the log directory are put in, every hashing and
proxying directive is the file's own. Used by tests/test_routing.py and bench/replicas_bench.py."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "deploy" / "nginx" / "symgate.conf"
# An upstream's server line: `server HOST:PORT [parameters];`.
SERVER_LINE = re.compile(r"^( *)server +(\S+:\d+)((?: +[^;\s]+)*);\n", re.M)
LISTEN_LINE = re.compile(r"^( *)listen +8002;$", re.M)
LOG_DIR = "/var/log/nginx/"


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def with_replicas(text: str, replicas: list[str]) -> str:
    """`text`'s upstream server lines replaced by one line per replica ("HOST:PORT"), each
    with the parameters the shipped lines have (max_fails, fail_timeout)."""
    lines = SERVER_LINE.findall(text)
    if not lines or len({(indent, params) for indent, _, params in lines}) != 1:
        raise ValueError("expected upstream server lines that differ only in their address")
    indent, _, params = lines[0]
    block = "".join(f"{indent}server {r}{params};\n" for r in replicas)
    first = SERVER_LINE.search(text)
    assert first is not None
    rest = SERVER_LINE.sub("", text[first.start():])
    return text[:first.start()] + block + rest


def front_config(prefix: Path, port: int, replicas: list[str], workers: int = 2) -> Path:
    """Write, under `prefix`, the shipped file made to listen on 127.0.0.1:`port` in front of
    `replicas`, logging to prefix/logs, and an nginx.conf that runs it in the foreground;
    the nginx.conf's path (run `nginx -p PREFIX -c PATH`)."""
    text = SHIPPED.read_text()
    text, n = LISTEN_LINE.subn(rf"\1listen 127.0.0.1:{port};", text)
    if n != 1:
        raise ValueError(f"expected one `listen 8002;` in {SHIPPED}, found {n}")
    if text.count(LOG_DIR) != 1:
        raise ValueError(f"expected one log path under {LOG_DIR} in {SHIPPED}")
    logs = prefix / "logs"
    for d in (logs, prefix / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    text = with_replicas(text.replace(LOG_DIR, f"{logs}/"), replicas)
    (prefix / "symgate.conf").write_text(text)
    # As root, nginx's workers would run as nobody, who cannot enter a 0700 temp directory.
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = prefix / "nginx.conf"
    conf.write_text(f"""{user}daemon off;
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {logs}/error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    include {prefix}/symgate.conf;
}}
""")
    return conf
