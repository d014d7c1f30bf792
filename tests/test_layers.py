"""The C++ layers include only downward (docs/architecture.md, "Layers").

Each folder under csrc/ is a layer with a rank; a file may include its own
layer and the layers below it, never one above. kernels/ (all CUDA device code)
is a library just above common/: it may include common/ and itself.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lower rank = lower layer. Same rank: siblings, which must not include each other.
LAYER_RANK = {
    "common": 0,
    "kernels": 1,
    "topology": 1,
    "inter": 1,
    "intra": 2,
    "plans": 3,
    "backend": 4,
    "ops": 4,
    "python": 5,
    "testing": 6,
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SOURCE_SUFFIXES = {".cpp", ".hpp", ".h", ".cu", ".cuh"}


def _layer_of_file(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "kernels":
        return "kernels"
    assert rel.parts[0] == "csrc", rel
    return rel.parts[1]


def _layer_of_include(include: str, including: pathlib.Path) -> str | None:
    first = include.split("/")[0]
    if first in LAYER_RANK:
        return first
    if "/" not in include and (including.parent / include).exists():
        return _layer_of_file(including.parent / include)  # a sibling file
    return None  # a system or third-party header


def _sources() -> list[pathlib.Path]:
    files = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES]
    files += [p for p in (ROOT / "kernels").rglob("*") if p.suffix in SOURCE_SUFFIXES]
    return sorted(files)


def _violations(files: list[pathlib.Path]) -> list[str]:
    out = []
    for path in files:
        mine = _layer_of_file(path)
        assert mine in LAYER_RANK, f"{path}: folder {mine!r} is not a known layer"
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            theirs = _layer_of_include(inc, path)
            if theirs is None or theirs == mine:
                continue
            if LAYER_RANK[theirs] >= LAYER_RANK[mine]:
                out.append(f"{path.relative_to(ROOT)} ({mine}) includes {inc} ({theirs})")
    return out


def test_every_source_folder_is_a_layer() -> None:
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders <= set(LAYER_RANK), folders - set(LAYER_RANK)


def test_includes_only_go_down() -> None:
    bad = _violations(_sources())
    assert not bad, "includes that go up or sideways:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_include(tmp_path: pathlib.Path) -> None:
    # The rule itself: a plan that includes the backend is caught.
    global ROOT
    saved = ROOT
    try:
        ROOT = tmp_path
        (tmp_path / "csrc" / "plans").mkdir(parents=True)
        (tmp_path / "csrc" / "backend").mkdir(parents=True)
        (tmp_path / "kernels").mkdir()
        (tmp_path / "csrc" / "backend" / "work.hpp").write_text("#pragma once\n")
        bad = tmp_path / "csrc" / "plans" / "bad.cpp"
        bad.write_text('#include "backend/work.hpp"\n#include <vector>\n')
        good = tmp_path / "csrc" / "backend" / "ok.cpp"
        good.write_text('#include "plans/x.hpp"\n#include "common/y.hpp"\n')
        assert _violations([bad]) == ["csrc/plans/bad.cpp (plans) includes backend/work.hpp (backend)"]
        assert _violations([good]) == []
    finally:
        ROOT = saved


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
