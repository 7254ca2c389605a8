"""The option table is the single source of every setting: the typed settings take their fields
and defaults from it, docs/options.md is generated from it, and the README names every option."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pyspark_durable_queue._options import OPTIONS, reference
from pyspark_durable_queue.settings import AddressSettings, ReadSettings, WriteSettings

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = ('python -c "from pyspark_durable_queue._options import reference; '
              "print(reference(), end='')\" > docs/options.md")


def fields(cls) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "extra":
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else "<required>"
    return out


def scope(name: str) -> dict[str, object]:
    return {o.key: o.default for o in OPTIONS if name in o.scopes}


def test_address_settings_are_the_address_options_with_their_defaults():
    assert fields(AddressSettings) == scope("address")


def test_read_settings_are_the_read_options():
    got, table = fields(ReadSettings), scope("read")
    assert set(got) == set(table)
    for key, default in got.items():
        if key in ("path", "address"):
            assert default == "<required>"
        elif key in scope("address"):
            assert default is None, key  # a read may override the address's value
        else:
            assert default == table[key], key


def test_write_settings_are_the_write_options_besides_address_settings():
    got = fields(WriteSettings)
    own = {k: v for k, v in scope("write").items() if k not in scope("address")}
    assert set(got) == set(own) | {"address_settings"}
    assert got["merge_schema"] == own["merge_schema"]


def test_docs_options_md_is_generated_from_the_table():
    text = (ROOT / "docs" / "options.md").read_text()
    assert text == reference(), f"docs/options.md is stale; regenerate it: {REGENERATE}"


@pytest.mark.parametrize("option", [o.name for o in OPTIONS])
def test_readme_documents_every_option(option):
    readme = (ROOT / "README.md").read_text()
    assert f"`{option}`" in readme, f"README.md does not mention the option {option}"
