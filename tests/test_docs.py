"""The documentation's runnable snippets run as written."""

import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.parametrize("i", range(len(snippets("integrations.md"))))
def test_integrations_page_snippets_run(i, tmp_path, monkeypatch):
    for mod in ("transformers", "accelerate", "lightning"):
        pytest.importorskip(mod)
    monkeypatch.chdir(tmp_path)  # snippets write their outputs to the working directory
    code = snippets("integrations.md")[i]
    exec(compile(code, f"docs/integrations.md snippet {i}", "exec"), {"__name__": "__docs__"})
    assert os.getcwd() == str(tmp_path)
