"""Configuration: one typed record in three tiers (csrc/common/config.hpp).

- The README's environment table is rendered from the settings table of the
  C++ record; this test fails when the two differ. `python tests/test_config.py
  --write` rewrites the README's table from the record.
- Agreed settings follow group rank 0 on every rank, whatever each rank's
  environment says, and a bad value fails with the variable named.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- env-table:begin -->", "<!-- env-table:end -->"


def _settings() -> list[dict[str, str]]:
    testing = pytest.importorskip("torchext._testing")
    return list(testing.config_settings())


def _cell(text: str) -> str:
    # A default with its own backticks or words stays as written; a bare value is code.
    if not text:
        return "-"
    if "`" in text or " " in text:
        return text
    return f"`{text}`"


def render_table(settings: list[dict[str, str]]) -> str:
    lines = ["| variable | tier | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        lines.append(
            f"| `{s['variable']}` | {s['tier']} | {_cell(s['default'])} | {s['meaning']} |"
        )
    return "\n".join(lines)


def _readme_table(text: str) -> str:
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert m, f"README.md lacks the {BEGIN} ... {END} markers"
    return m.group(1)


def test_readme_table_is_the_config_record() -> None:
    settings = _settings()
    table = _readme_table(README.read_text())
    rendered = render_table(settings)
    # FASTCOMM_MATMUL_* are the ops' debug settings, listed after the record's.
    kept = "\n".join(l for l in table.splitlines() if "FASTCOMM_MATMUL_" not in l)
    assert kept == rendered, (
        "README.md's environment table differs from csrc/common/config.cpp's settings; "
        "run `python tests/test_config.py --write`"
    )


def test_every_tier_is_used_and_variables_are_unique() -> None:
    settings = _settings()
    names = [s["variable"] for s in settings]
    assert len(names) == len(set(names)), names
    assert {s["tier"] for s in settings} == {"agreed", "local", "debug"}
    assert all(n.startswith("FASTCOMM_") and s["meaning"] for n, s in zip(names, settings))


@pytest.mark.parametrize(
    "var,value",
    [
        ("FASTCOMM_TRANSPORT", "udp"),
        ("FASTCOMM_CHUNK_BYTES", "lots"),
        ("FASTCOMM_CUDA_WINDOW", "2"),
        ("FASTCOMM_TCP_SOCKETS", "0"),
        ("FASTCOMM_CUDA_INTER", "gloo"),
        ("FASTCOMM_NVLINK", "on"),
    ],
)
def test_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    testing = pytest.importorskip("torchext._testing")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        testing.config_from_env()


def agreed_fn(rank: int, ws: int) -> dict[str, str]:
    import torch
    import torch.distributed as dist

    import torchext

    backend = torchext._backend(None)
    fields = dict(kv.split("=", 1) for kv in backend.config().split())
    t = torch.arange(300_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    expect = torch.arange(300_000, dtype=torch.float32) * sum(range(1, ws + 1))
    assert torch.equal(t, expect)
    return {k: fields[k] for k in ("chunk_bytes", "cuda_inter", "cuda_window", "cuda_lag")}


def test_agreed_settings_follow_group_rank_zero() -> None:
    """Two simulated nodes x 2 ranks whose environments disagree on agreed settings:
    every rank runs with group rank 0's, its own local ones stay (the lag fitted to the
    agreed window), and a collective over the hierarchical plan is right."""
    from _harness import BACKEND, run_ranks

    if BACKEND != "fastcomm":
        pytest.skip("fastcomm's own settings")

    def env(r: int) -> dict[str, str]:
        return {
            "FASTCOMM_HOST_ID": f"cfgnode{r // 2}",
            "FASTCOMM_CHUNK_BYTES": "64K" if r == 0 else "256K",
            "FASTCOMM_CUDA_INTER": "host" if r == 0 else "nccl",
            "FASTCOMM_CUDA_WINDOW": "4" if r == 0 else "16",
            "FASTCOMM_CUDA_LAG": "2" if r == 0 else "9",
        }

    res = run_ranks(4, agreed_fn, env=env, timeout_s=180)
    for r, fields in enumerate(res):
        assert fields["chunk_bytes"] == "64K", (r, fields)
        assert fields["cuda_inter"] == "host", (r, fields)
        assert fields["cuda_window"] == "4", (r, fields)
        assert fields["cuda_lag"] == ("2" if r == 0 else "3"), (r, fields)


def _write() -> None:
    sys.path.insert(0, str(ROOT))
    import torchext._testing as testing

    text = README.read_text()
    old = _readme_table(text)
    matmul = [l for l in old.splitlines() if "FASTCOMM_MATMUL_" in l]
    new = "\n".join([render_table(list(testing.config_settings()))] + matmul)
    README.write_text(text.replace(old, new))
    print(f"{README}: environment table rewritten from the config record")


if __name__ == "__main__":
    if "--write" in sys.argv:
        _write()
    else:
        raise SystemExit(pytest.main([__file__, "-q"]))
