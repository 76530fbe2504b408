"""report.html in a real browser (headless Chromium driven by playwright; the marker `browser`, a CI step of its
own after the meta tier): at 1280 px the main column does not overflow sideways, the verdict and why are
on the first screen without scrolling, and every link resolves (an anchor to an element of the page, a
file to a file of the bundle). A screenshot of the first screen is kept beside the bundle.

Skipped, saying why, where playwright or chromium is missing (`pip install -e .[browser]`; `apt-get install
chromium`). WEIGHTSYNC_REPORT_BUNDLE=DIR checks a real certify bundle too (e.g. one of `certify --quick`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from suites.meta.report_samples import write_sample

pytestmark = pytest.mark.browser

WIDTH, HEIGHT = 1280, 800
#: Debian's chromium (never a browser playwright downloads: CI reaches no network beyond package registries).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium_path() -> str:
    path = (
        os.environ.get("WEIGHTSYNC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if not path:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it where missing)")
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[browser]')"
    )
    executable = chromium_path()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


def bundles(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, failing in (("sample-fail", True), ("sample-pass", False)):
        out[name] = tmp_path_factory.mktemp(name)
        write_sample(out[name], failing=failing)
    if os.environ.get("WEIGHTSYNC_REPORT_BUNDLE"):
        out["given"] = Path(os.environ["WEIGHTSYNC_REPORT_BUNDLE"])
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return bundles(tmp_path_factory)


@pytest.fixture(params=["sample-fail", "sample-pass", "given"])
def page_of(request, browser, written):
    """(bundle, page) with the bundle's report.html loaded from its file at 1280 × 800."""
    if request.param not in written:
        pytest.skip("WEIGHTSYNC_REPORT_BUNDLE is not set (a real bundle to check too)")
    bundle = written[request.param]
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    page.goto((bundle / "report.html").resolve().as_uri())
    shots = Path(os.environ.get("WEIGHTSYNC_REPORT_SCREENSHOTS") or bundle)
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"report-{request.param}-first-screen.png"))
    yield bundle, page
    page.close()


#: The page's widths at its viewport, and the elements of <main> that reach past its right edge (a table or a
#: <pre> scrolls inside its own box, so neither counts).
OVERFLOW_JS = """() => { const m = document.querySelector('main');
    const wide = [...m.querySelectorAll('*')].filter(el => !el.closest('.scroll, pre'))
      .filter(el => el.getBoundingClientRect().right > m.getBoundingClientRect().right + 1)
      .map(el => el.tagName + ' ' + (el.textContent || '').slice(0, 60));
    return {doc: document.documentElement.scrollWidth, view: window.innerWidth,
            main: m.scrollWidth, mainClient: m.clientWidth, wide}; }"""

#: Every link of the page: its href, its resolved URL, and for an anchor whether an element has that id.
LINKS_JS = """() => [...document.querySelectorAll('a[href]')].map(a => ({href: a.getAttribute('href'), url: a.href,
    target: a.getAttribute('href').startsWith('#')
      ? !!document.getElementById(decodeURIComponent(a.getAttribute('href').slice(1))) : null}))"""


def overflow(page) -> list[str]:
    """What overflows: the page sideways, or <main>, or an element of <main> past its right edge."""
    w = page.evaluate(OVERFLOW_JS)
    out = [f"the page scrolls sideways ({w['doc']} > {w['view']} px)"] if w["doc"] > w["view"] else []
    out += (
        [f"main scrolls sideways ({w['main']} > {w['mainClient']} px)"] if w["main"] > w["mainClient"] else []
    )
    return out + w["wide"]


def broken_links(page, bundle: Path) -> list[str]:
    """Anchors no element has, and files that are not in the bundle."""
    out = []
    for link in page.evaluate(LINKS_JS):
        if link["href"].startswith("#"):
            out += [] if link["target"] else [f"{link['href']} (no element has that id)"]
        elif not Path(unquote(urlparse(link["url"]).path)).exists():
            out.append(f"{link['href']} (not in the bundle {bundle})")
    return out


def test_the_checks_see_an_overflow_and_a_broken_link(browser, tmp_path):
    """The checks below are only as good as their reading of the page: a made-up page with a wide element
    and two broken links must be seen."""
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    html_file = tmp_path / "report.html"
    html_file.write_text(
        "<html><body><main style='max-width:600px'><div style='width:3000px'>wide</div>"
        "<div class='scroll' style='overflow-x:auto'><table style='width:3000px'><tr><td>ok</td></tr></table></div>"
        "<a href='#nowhere'>a</a><a href='gone.json'>b</a><h2 id='here'>h</h2><a href='#here'>c</a></main></body></html>"
    )
    page.goto(html_file.as_uri())
    found, links = overflow(page), broken_links(page, tmp_path)
    page.close()
    assert any(f.startswith("DIV wide") for f in found) and not any("ok" in f for f in found), found
    assert len(links) == 2 and "#nowhere" in links[0] and "gone.json" in links[1], links


def test_the_main_column_does_not_overflow_at_1280_px(page_of):
    _, page = page_of
    found = overflow(page)
    assert not found, f"at {WIDTH} px: {found}"


def test_the_verdict_and_why_are_visible_without_scrolling(page_of):
    _, page = page_of
    boxes = page.evaluate(
        """() => [...document.querySelectorAll('.first .verdict, .first > p')].map(el => {
            const r = el.getBoundingClientRect(); return {text: el.textContent.slice(0, 80), top: r.top, bottom: r.bottom}; })"""
    )
    assert boxes and boxes[0]["text"].split(" ")[0] in ("PASS", "FAIL", "COULD"), boxes
    hidden = [b for b in boxes if b["top"] < 0 or b["bottom"] > HEIGHT]
    assert not hidden, f"below the first {HEIGHT} px of a {WIDTH} px window: {hidden}"


def test_every_link_resolves(page_of):
    bundle, page = page_of
    assert page.evaluate(LINKS_JS), "report.html links nothing: its sections and the bundle's files should be"
    broken = broken_links(page, bundle)
    assert not broken, f"report.html's links that do not resolve: {broken}"
