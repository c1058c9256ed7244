"""The browser the playground's tests drive: Debian's ``chromium`` package through playwright's
``executable_path`` (nothing downloads a browser). Without it the tests skip, except on CI (``CI``
or ``STEERABLE_REQUIRE_BROWSER=1``), where a missing browser must fail, not silently skip.
``STEERABLE_CHROMIUM`` names another Chromium binary (or a missing one, to check that path)."""

from __future__ import annotations

import importlib.util
import os

import pytest

CHROMIUM = os.environ.get("STEERABLE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]


def require_browser() -> None:
    missing = [what for what, ok in [(CHROMIUM, os.path.exists(CHROMIUM)),
                                     ("playwright", importlib.util.find_spec("playwright") is not None)] if not ok]
    if not missing:
        return
    message = (f"the playground's browser tests need {' and '.join(missing)}: apt-get install -y chromium "
               "(Debian's package) and pip install playwright; never 'playwright install'")
    if os.environ.get("CI") or os.environ.get("STEERABLE_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)
