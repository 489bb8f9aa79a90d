"""Headless Chromium driven by selenium, for the web page's tests and its bench (appliance/web/): Debian's
`chromium` and `chromium-driver` packages (`make test` installs them), a new profile per browser.

The flags: `--no-sandbox` because the tests run as root in CI (Chromium refuses to sandbox as root);
`--disable-background-networking`, `--disable-component-update`, `--disable-sync`, `--no-first-run` and
`--disable-quic` because without them Chromium opens connections to Google's services at start, which are refused
here many at a time and slow every page load; `--disable-gpu` (no GPU in CI). The browser's console is read through
`goog:loggingOptions` (selenium's `get_log("browser")`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = ("chromium", "chromium-browser")
CHROMEDRIVER = "chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def missing() -> str | None:
    """Why no browser can run here (None: it can)."""
    if not any(shutil.which(name) for name in CHROMIUM):
        return "no chromium on PATH (`make test` installs Debian's chromium and chromium-driver as root)"
    if not shutil.which(CHROMEDRIVER):
        return "no chromedriver on PATH (`make test` installs Debian's chromium-driver as root)"
    return None


class Browser:
    """`with Browser() as driver:` a headless Chromium (selenium WebDriver) with its own temporary profile, quit
    and deleted at the end; `flags`: more command-line flags (a test's `--ignore-certificate-errors` for a
    self-signed certificate)."""

    def __init__(self, width: int = 1280, height: int = 900, flags: tuple[str, ...] = ()):
        self.size = (width, height)
        self.flags = flags
        self.profile = Path(tempfile.mkdtemp(prefix="appliance-chromium-"))
        self.driver: Any = None

    def __enter__(self) -> Any:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = next(p for p in map(shutil.which, CHROMIUM) if p)
        for flag in (*FLAGS, *self.flags):
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.add_argument(f"--window-size={self.size[0]},{self.size[1]}")
        options.set_capability("goog:loggingOptions", {"browser": "ALL"})
        self.driver = webdriver.Chrome(options=options, service=Service(shutil.which(CHROMEDRIVER)))
        return self.driver

    def __exit__(self, *exc) -> None:
        try:
            if self.driver is not None:
                self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
