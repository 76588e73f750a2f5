"""The configuration page lists every setting exactly as `gateway/settings.py` declares it."""

from __future__ import annotations

from gateway.settings import setting_names
from tools import settings_doc


def test_the_configuration_page_is_current() -> None:
    page = settings_doc.PAGE.read_text()
    assert settings_doc.render_page(page) == page, (
        f"{settings_doc.PAGE.relative_to(settings_doc.ROOT)} differs from gateway/settings.py: "
        f"run `.venv/bin/python -m {settings_doc.COMMAND.removeprefix('python -m ')}` and commit the page"
    )


def test_every_setting_has_a_row_with_a_description() -> None:
    block = settings_doc.render_block()
    rows = {line.split("|")[1].strip().strip("`"): line for line in block.splitlines() if line.startswith("| `")}
    assert sorted(rows) == sorted(setting_names())
    assert all(line.rstrip(" |").split("|")[-1].strip() for line in rows.values())


def test_a_stale_page_is_rewritten_between_its_markers_only() -> None:
    stale = f"# Title\n\nprose\n\n{settings_doc.BEGIN}\n| old |\n{settings_doc.END}\nafter\n"
    fresh = settings_doc.render_page(stale)
    assert fresh.startswith("# Title\n\nprose\n\n") and fresh.endswith(f"{settings_doc.END}\nafter\n")
    assert "| old |" not in fresh and "`NEMOTRON_RELAY__CHUNK_TIMEOUT`" in fresh
