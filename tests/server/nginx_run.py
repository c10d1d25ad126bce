"""Start nginx (Debian's) in the foreground on loopback with every path under a prefix, in front
of moed replicas, using conf/nginx-moed.conf (for tests/server/test_nginx.py and
bench/bench_load.py)."""

import os
import re
import shutil
import socket
import subprocess
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def start_nginx(prefix, port, upstreams, site_text=None):
    """nginx in the foreground with every path under prefix; the site is conf/nginx-moed.conf
    with its listen address and upstream servers pointed at this test's ports."""
    site = site_text or open(os.path.join(ROOT, "conf", "nginx-moed.conf")).read()
    site = re.sub(r"^\tlisten 80;$", "\tlisten 127.0.0.1:%d;" % port, site, flags=re.M)
    servers = [l for l in site.splitlines() if re.match(r"^\tserver 127\.0\.0\.1:\d+ ", l)]
    assert len(servers) == len(upstreams), servers
    for line, up in zip(servers, upstreams):
        site = site.replace(line, re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:%d" % up, line))
    open(os.path.join(prefix, "site.conf"), "w").write(site)
    for d in ("tmp", "logs"):
        os.makedirs(os.path.join(prefix, d), exist_ok=True)
    main = """daemon off;
worker_processes 1;
pid %(p)s/nginx.pid;
error_log %(p)s/logs/error.log warn;
events { worker_connections 1024; }
http {
	access_log %(p)s/logs/access.log;
	client_body_temp_path %(p)s/tmp/body;
	proxy_temp_path %(p)s/tmp/proxy;
	fastcgi_temp_path %(p)s/tmp/fastcgi;
	uwsgi_temp_path %(p)s/tmp/uwsgi;
	scgi_temp_path %(p)s/tmp/scgi;
	include %(p)s/site.conf;
}
""" % {"p": prefix}
    open(os.path.join(prefix, "nginx.conf"), "w").write(main)
    os.chmod(prefix, 0o755)
    args = [NGINX, "-p", prefix, "-c", os.path.join(prefix, "nginx.conf"), "-e",
            os.path.join(prefix, "logs", "error.log")]
    r = subprocess.run(args + ["-t"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("nginx -t failed: " + r.stderr)
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("nginx did not start: " + open(os.path.join(prefix, "logs", "error.log")).read())
