"""The page of tmt serve in a real browser: Debian's chromium and chromedriver, driven by selenium
(`make test-browser` installs them if missing; nothing is downloaded at run time). A German
sentence typed into the page comes back as the translation tmt translate gives.

TMT_PAGE_MODEL serves another model (the README's screenshot: a Multi30k run), and
TMT_PAGE_SCREENSHOT=FILE keeps the screenshot there."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_serve import Server

from transformer_mt.translation import translate

pytestmark = pytest.mark.browser
SENTENCES = ["Ein Hund rennt über eine grüne Wiese.", "Zwei Kinder spielen im Sand."]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path: Path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: make test-browser installs them")
    os.environ["SE_OFFLINE"] = "true"  # selenium must not fetch a driver or a browser
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as ChromeService

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1200,1500",
                 f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_the_page_translates_what_is_typed_as_tmt_translate_does(
    browser, multi30k_run: Path, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model = Path(os.environ.get("TMT_PAGE_MODEL") or multi30k_run)
    expected = translate.translate_text(translate.load_translator(model), SENTENCES)
    assert all(expected) and len(set(expected)) == 2, expected  # else the check proves nothing
    server = Server(model)
    try:
        browser.get(server.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#card tr"))
        browser.find_element(By.ID, "source").send_keys("\n".join(SENTENCES))
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#output .best")) == len(SENTENCES)
        )
        shown = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#output .best")]
        assert shown == [text.strip() for text in expected]
        status = browser.find_element(By.ID, "status").text
        assert status.startswith("2 lines in ") and status.endswith(" ms"), status
        card = browser.find_element(By.ID, "card").text
        assert "parameters" in card and "updates trained" in card
        # a run directory's model (the fixture's is one): its training curves are on the page
        assert server.client.get("/v1/model").json()["curves"] or "TMT_PAGE_MODEL" in os.environ
        WebDriverWait(browser, 60).until(lambda d: d.execute_script(
            "const c = document.getElementById('curves');"
            " return c.style.display === 'block' && c.complete && c.naturalWidth > 0"))  # fmt: skip
        browser.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 10_000
        if os.environ.get("TMT_PAGE_SCREENSHOT"):
            shutil.copy(tmp_path / "page.png", os.environ["TMT_PAGE_SCREENSHOT"])
    finally:
        assert server.stop() == 0


def test_the_page_takes_a_glossary_and_shows_what_it_did(
    browser, multi30k_run: Path, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(multi30k_run, "--set", f"serve.glossary_dir={tmp_path / 'glossaries'}")
    try:
        browser.get(server.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#card tr"))
        browser.find_element(By.ID, "source").send_keys("Ein Mann mit einem Hut.")
        browser.find_element(By.CSS_SELECTOR, "#glossary-box summary").click()
        browser.find_element(By.ID, "glossary").send_keys("Mann\tguy\nHut\tcap")
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#output .terms")
        )
        shown = browser.find_element(By.CSS_SELECTOR, "#output .best").text
        assert "guy" in shown.split() and "cap" in shown.replace(".", " ").split(), shown
        terms = browser.find_element(By.CSS_SELECTOR, "#output .terms")
        assert "Mann → guy" in terms.text and "Hut → cap" in terms.text, terms.text
        assert "missed" not in terms.get_attribute("class")
    finally:
        assert server.stop() == 0
