"""`make gpu-check` runs on a bare CUDA machine without the package registry (.ci/gpu-check).

The dry mode resolves the install against .gpu-wheels/ with pip's resolver and no index, for
this interpreter and from scratch for CPython 3.10-3.12; those tests need the folder
(`make gpu-wheels`) and are skipped without it: nothing here downloads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / ".ci" / "gpu-check"
WHEELS = REPO / ".gpu-wheels"
_PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TRANSFORMERS = next(r for r in _PROJECT["dependencies"] if r.startswith("transformers"))
PYTEST = next(r for r in _PROJECT["optional-dependencies"]["test"] if r.startswith("pytest"))
needs_wheels = pytest.mark.skipif(
    not any(WHEELS.glob("pytest-*.whl")), reason="no .gpu-wheels/ here (`make gpu-wheels` fills it)"
)


def _gpu_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "GPU_CHECK_", "TRITON_"))}
    clean.pop("OUT", None)
    clean.update(PYTHON=sys.executable, TMPDIR=str(tmp_path), **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=300)


def test_make_gpu_check_runs_the_script_alone():
    """No `setup` prerequisite: that creates .venv and installs from the registry."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # as if run alone
    res = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.split("\n")[0] == "bash .ci/gpu-check", res.stdout


def test_kernel_tests_import_no_recorders_or_duckdb():
    """The shared conftest pulls the dashboard's runs root (runlog, recorders, pyarrow, DuckDB) only in its fixture."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import conftest; "
        "print(sorted(m for m in ('app_runs', 'runlog', 'recorders', 'duckdb', 'pyarrow') if m in sys.modules))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "tests"), str(REPO)], capture_output=True, text=True, check=True
    )
    assert res.stdout.strip() == "[]"


def test_missing_wheels_folder_says_how_to_fill_it(tmp_path):
    res = _gpu_check(tmp_path, GPU_WHEELS=str(tmp_path / "absent"))
    assert res.returncode == 1
    assert "no wheels folder" in res.stderr and "make gpu-wheels" in res.stderr


@pytest.mark.slow
def test_without_cuda_it_stops_before_installing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    empty = tmp_path / "wheels"
    empty.mkdir()
    res = _gpu_check(tmp_path, GPU_WHEELS=str(empty))
    assert res.returncode == 1
    assert "sees no CUDA device" in res.stderr and "GPU_CHECK_ALLOW_CPU=1" in res.stderr
    assert "pip install" not in res.stdout


@pytest.mark.slow
@needs_wheels
def test_dry_run_resolves_every_requirement_from_the_wheels_offline(tmp_path):
    import transformers

    res = _gpu_check(tmp_path, GPU_CHECK_DRY="1")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert f"--no-index --find-links {WHEELS} {PYTEST}" in out
    assert f"the machine's transformers {transformers.__version__}: inside {TRANSFORMERS[12:]}" in out
    tests = "tests/test_runtime_kernels.py tests/test_runtime.py tests/test_runtime_graphs.py"
    assert f"python -m pytest -q -p no:cacheprovider -m kernel {tests}" in out
    assert "python -m commands.cli bench kernels" in out
    assert "python -m commands.cli bench kernels --shape llama3-8b --no-kernels --max-batch 32768" in out
    for version in ("3.10", "3.11", "3.12"):
        assert f"CPython {version} from scratch: {PYTEST} resolve" in out
    assert not list(WHEELS.glob("transformers-*.whl")), "the GPU machine brings its own transformers"


@pytest.mark.slow
@needs_wheels
def test_dry_run_fails_when_a_needed_wheel_is_missing(tmp_path):
    """The same check against the folder less pluggy, which pytest needs from scratch."""
    partial = tmp_path / "wheels"
    partial.mkdir()
    for whl in WHEELS.glob("*.whl"):
        if not whl.name.startswith("pluggy-"):
            (partial / whl.name).symlink_to(whl)
    res = _gpu_check(tmp_path, GPU_CHECK_DRY="1", GPU_WHEELS=str(partial))
    assert res.returncode == 1
    assert "do not resolve from" in res.stderr and "CPython 3.10" in res.stderr


@pytest.mark.slow
@pytest.mark.kernel
def test_cpu_rehearsal_runs_every_step_when_the_interpreter_holds_pytest(tmp_path):
    """GPU_CHECK_ALLOW_CPU=1 with an empty wheels folder: this interpreter already holds pytest, so
    the venv installs nothing, says so, and the check goes on to the kernel tests and the bench."""
    empty = tmp_path / "wheels"
    empty.mkdir()
    out = tmp_path / "out"
    res = _gpu_check(
        tmp_path,
        GPU_WHEELS=str(empty),
        GPU_CHECK_ALLOW_CPU="1",
        GPU_CHECK_PYTEST_ARGS="-k test_decode_ties_evict_the_older_position",
        OUT=str(out),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "nothing (the interpreter holds them all)" in res.stdout
    assert "2 passed" in (out / "kernel-tests.log").read_text()
    assert "Correctness summary in Triton's interpreter" in (out / "bench-kernels.log").read_text()
    assert res.stdout.rstrip().endswith("gpu-check: all steps passed")
    assert (out / "pytest.xml").is_file()
