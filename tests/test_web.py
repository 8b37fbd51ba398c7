"""The live page at / in a real headless Chromium (Debian's, driven by selenium + chromedriver)."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.server_utils import running_server


@pytest.fixture
def browser():
    assert shutil.which("chromium") and shutil.which("chromedriver"), \
        "the browser test needs Debian's chromium and chromium-driver (make test installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


def test_chat_streams_and_grid_changes(browser):
    with running_server("smollm2-135m", kv_cache_memory="64MiB") as (url, _):
        browser.get(url)
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "test-model")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .block")) > 0)
        assert not browser.find_elements(By.CSS_SELECTOR, "#grid .block[data-state=used]")
        browser.find_element(By.ID, "input").send_keys("Write a long poem about the sea.")
        browser.find_element(By.ID, "send").click()
        answer = (By.CSS_SELECTOR, ".msg.assistant")
        # while the answer streams in, the request owns blocks in the grid
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#grid .block[data-state=used]"))
        partial = wait.until(lambda d: d.find_element(*answer).text or False)
        wait.until(lambda d: d.find_element(*answer).get_attribute("data-done") == "1")
        final = browser.find_element(*answer).text
        assert len(final) > len(partial) > 0  # it arrived in pieces
        # once finished, its full blocks stay as cached prefix blocks
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#grid .block[data-state=cached]"))
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#grid .block[data-state=used]"))  # painted back to free
        total = int(browser.find_element(By.ID, "total").text)
        assert total > 0 and len(browser.find_elements(By.CSS_SELECTOR, "#grid .block")) == total
        cached = len(browser.find_elements(By.CSS_SELECTOR, "#grid .block[data-state=cached]"))
        assert cached == int(browser.find_element(By.ID, "cached").text)


def test_page_takes_the_api_key(browser):
    """With --api-key the page's state and chat need the key; typed into the page, both work."""
    with running_server("smollm2-135m", kv_cache_memory="64MiB", api_key="s3cret") as (url, _):
        browser.get(url)
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: "API key" in d.find_element(By.ID, "layout").text)
        assert not browser.find_elements(By.CSS_SELECTOR, "#grid .block")
        key = browser.find_element(By.ID, "key")
        key.send_keys("s3cret")
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .block")) > 0)
        browser.find_element(By.ID, "input").send_keys("Say hello.")
        browser.find_element(By.ID, "send").click()
        answer = (By.CSS_SELECTOR, ".msg.assistant")
        wait.until(lambda d: d.find_element(*answer).get_attribute("data-done") == "1")
        assert not browser.find_element(*answer).text.startswith("error")
