"""Package metadata (pyproject.toml): the license text, the short index page, the project URLs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
HOME = "https://github.com/ep-runtime/ep_runtime"
# MD5 of the Apache License 2.0 as published at https://www.apache.org/licenses/LICENSE-2.0.txt
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


@pytest.fixture(scope="module")
def project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_license_is_the_full_apache_2_0_text(project):
    assert project["license"] == {"text": "Apache-2.0"}
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_MD5


def test_readme_is_a_short_page_with_the_install_commands(project):
    page = ROOT / project["readme"]
    assert page.name != "README.md" and page.stat().st_size < 4096
    text = page.read_text()
    assert 'pip install "ep_runtime[sim]"' in text and 'pip install "ep_runtime[gpu]"' in text


def test_project_urls_point_at_the_repository(project):
    urls = project["urls"]
    assert urls["Homepage"] == HOME and urls["Source"] == HOME and urls["Issues"] == f"{HOME}/issues"
