"""nginx as the reference proxy of the overhead benchmark: what relaying the same bytes costs a C proxy.

One nginx process (`master_process off`, one worker: its CPU time is one pid's) proxies to the stub engine
over kept-alive upstream connections with buffering off, as the shipped site does for SSE. The benchmark
runs it next to the gateway so every run prints the gateway's cost as a multiple of nginx's.
Imports nothing from `gateway`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loadtest.processes import BenchProcess

_CONFIG = """daemon off;
master_process off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """The nginx executable, if one is installed."""
    found = shutil.which("nginx")
    if found is None and Path("/usr/sbin/nginx").exists():
        found = "/usr/sbin/nginx"
    return found


def nginx_process(binary: str, root: Path, port: int, engine_port: int, core: int | None) -> BenchProcess:
    """A BenchProcess running nginx on `port` in front of the engine on `engine_port`; config and temp files
    under `root` (the caller's temporary directory)."""
    config = root / "nginx.conf"
    config.write_text(_CONFIG.format(root=root, port=port, engine_port=engine_port))
    return BenchProcess("nginx", [binary, "-p", str(root), "-c", str(config)], core=core)
