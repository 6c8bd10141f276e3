"""MkDocs hooks (`hooks:` in mkdocs.yml): add the generated reference pages to the build.

Each page of `tools/docs_reference.PAGES` is rendered from the code (argparse parsers, the
deployment dataclasses, the Prometheus collectors) when the site is built and added as a
generated file, never written into docs/, so the reference cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File, Files  # noqa: E402

from tools.docs_reference import PAGES  # noqa: E402


def on_files(files: Files, config: Any) -> Files:
    for src_uri, render in PAGES.items():
        existing = files.get_file_from_path(src_uri)
        if existing is not None:  # a stale hand-written copy never wins over the code
            files.remove(existing)
        files.append(File.generated(config, src_uri, content=render()))
    return files
