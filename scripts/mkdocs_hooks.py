"""MkDocs hooks: files the site shows that live outside `docs/`.

The benchmark chart stays where `python -m benchmarks.run` writes it and the
changelog at the repository root; the site publishes both from there, so
there is one copy of each.
"""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "benchmarks" / "results" / "results.png"
CHANGELOG = ROOT / "CHANGELOG.md"


def on_files(files, config):
    files.append(
        File.generated(config, "img/benchmarks.png", abs_src_path=str(CHART))
    )
    files.append(
        File.generated(config, "changelog.md", content=CHANGELOG.read_text())
    )
    return files
