"""The browser the playground's tests drive: Debian's ``chromium`` package through playwright's
``executable_path`` (nothing downloads a browser). Without it the tests skip, except on CI (``CI``
or ``STEERABLE_REQUIRE_BROWSER=1``), where a missing browser must fail, not silently skip.
``STEERABLE_CHROMIUM`` names another Chromium binary (or a missing one, to check that path).

The fixtures and helpers the playground's browser test modules share (import them from here): one
Chromium per module, a fresh tab per test, screenshots to a temp folder named at the start."""

from __future__ import annotations

import importlib.util
import os

import pytest
from server_harness import USER

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


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium for the module. The tests wait through ``expect`` rather than
    ``wait_for_function``, whose string predicates the page's Content-Security-Policy refuses."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000})
        yield context
        context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("playground-screenshots")
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\nplayground screenshots: {folder}")
    return folder


@pytest.fixture
def page(browser, server):
    """A fresh tab (its own sessionStorage) on the playground; a JavaScript error fails the test."""
    tab = browser.new_page()
    errors = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.goto(f"{server.url}/playground")
    yield tab
    tab.close()
    assert not errors, errors


def expect(locator):
    from playwright.sync_api import expect as playwright_expect
    return playwright_expect(locator)


def enter_key(page, key: str) -> None:
    page.focus("#api-key")
    page.keyboard.type(key)
    page.keyboard.press("Enter")
    expect(page.locator("#key-status")).to_contain_text("key:")


def choose_module(page, name: str, info: str) -> None:
    page.select_option("#module", name)
    expect(page.locator("#module-info")).to_contain_text(info)


def press_run(page) -> None:
    """Press Run and wait for both panes to finish."""
    page.focus("#run")
    page.keyboard.press("Enter")
    expect(page.locator("#run-status")).not_to_have_text("Running…", timeout=60_000)
    assert page.text_content("#run-status") == "Done.", page.text_content("#run-error")


def run_page(page, prompt: str, scale_steps: int) -> None:
    """Type the prompt, move the scale slider with the arrow keys, press Run, wait for both panes."""
    page.focus("#prompt")
    page.keyboard.type(prompt)
    page.focus("#scale")
    for _ in range(abs(scale_steps)):
        page.keyboard.press("ArrowRight" if scale_steps > 0 else "ArrowLeft")
    press_run(page)


def api_run(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body, headers=USER)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]
