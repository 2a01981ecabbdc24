"""What ``tools/check_site.py`` needs around the browser: Chromium and a Chinese font (installed with apt-get
where that is possible), a local server for the built site, and a guard that keeps every request on it."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlsplit

CHROMIUM_CANDIDATES = ["/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser"]


class Missing(Exception):
    """Something the check needs is not installed."""


def apt_install(*packages: str) -> bool:
    """Install Debian packages when running as root with apt-get; False where that is not possible."""
    if not shutil.which("apt-get") or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    print(f"installing {' '.join(packages)} with apt-get ...", flush=True)
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True)
        return subprocess.run(cmd, capture_output=True).returncode == 0
    return True


def find_chromium(install: bool = True) -> str:
    for path in CHROMIUM_CANDIDATES:
        if Path(path).exists():
            return path
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if install and apt_install("chromium"):
        return find_chromium(install=False)
    raise Missing("Chromium is not installed: run `apt-get install -y chromium` (as root) and retry")


def check_cjk_font(install: bool = True) -> str:
    fonts = ""
    if shutil.which("fc-list"):
        fonts = subprocess.run(
            ["fc-list", ":lang=zh", "family"], capture_output=True, text=True
        ).stdout.strip()
    if fonts:
        return fonts.splitlines()[0]
    if install and apt_install("fontconfig", "fonts-noto-cjk"):
        return check_cjk_font(install=False)
    raise Missing(
        "no Chinese font is installed (fc-list :lang=zh is empty): run `apt-get install -y fonts-noto-cjk`"
    )


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``site`` on 127.0.0.1 (a free port) in a background thread: (the server, its base URL)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """No log line per request: the checks' own lines are the output."""

    def log_message(self, *args):
        pass


def keep_requests_local(page, external: list[str]) -> None:
    """Abort every request to another host (recording its URL in ``external``): the site must work offline."""

    def route(r):
        host = urlsplit(r.request.url).hostname
        if r.request.url.startswith(("data:", "blob:")) or host == "127.0.0.1":
            return r.continue_()
        external.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
