"""nanokv as users install it: the built wheel and sdist carry every file a run needs (the CPU
kernels' C sources above all), and each, installed into a fresh virtual environment outside the
checkout, runs ``nanokv generate`` on the C kernels it compiles from its own copy of them.

And the start explains itself: no compiler, a bad ``NANOKV_CPU_ISA``, a broken cached library
or an impossible ``--threads`` give one line (a note, an error or a usage error), never a
traceback; ``nanokv doctor`` reports what this machine gives nanokv.

The virtual environments see the running interpreter's site-packages (torch, the default model
and the other dependencies are installed once, by the README's commands), whether that is the
system Python or a venv, and pip installs with ``--no-index``: a dependency the package
declares but the environment lacks fails the install, offline.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from nanokv_cli.engine.config import available_cpus
from nanokv_cli.engine.cpu import build

# Slow as a whole (builds, installs, runs): not in the fast subset (-m 'not slow').
pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
TIMEOUT_S = 300  # a fresh kernel build takes ~5 s; pip installs take a few


def nanokv(args: list, *, env: dict | None = None, cwd: Path, exe: list | None = None):
    """``nanokv ARGS`` in a subprocess, from ``cwd`` (never the checkout, unless asked)."""
    command = exe or [sys.executable, "-m", "nanokv_cli.cli"]
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def package_files() -> list[str]:
    """The files of the package in the checkout, as the distributions must hold them."""
    files = []
    for path in sorted((REPO / "nanokv_cli").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files.append(path.relative_to(REPO).as_posix())
    return files


def source_tree(dest: Path) -> Path:
    """The checkout's files that git tracks or would (a clean clone's), copied to ``dest``:
    building writes egg-info and build folders, which must not land in the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def fresh_venv(venv: Path) -> Path:
    """A new virtual environment that sees the running interpreter's packages; its python.

    ``--system-site-packages`` would give it the base installation's, which in a venv is not
    where the tests' dependencies are: a ``.pth`` file names the running site-packages
    instead (as plain paths, so their own ``.pth`` files, such as the checkout's editable
    install, do not run). No pip of its own: the venv's bundled pip and setuptools would shadow
    the running ones (torch requires setuptools>=77); that pip installs into it.
    """
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT_S,
    ).stdout.strip()
    outer = [p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()]
    Path(purelib, "_running_site_packages.pth").write_text("\n".join(outer) + "\n")
    return python


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built by setuptools' PEP 517 hooks (as pip and build do)."""
    tree = source_tree(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("dist")
    built = {}
    for kind in ("wheel", "sdist"):
        # One process per hook, as pip and build run them (setuptools keeps state between
        # calls); setuptools logs to stdout, so the hook's answer goes to a file.
        answer = out / f"{kind}.txt"
        hook = (
            "import sys, pathlib; from setuptools import build_meta as b; "
            f"pathlib.Path(sys.argv[2]).write_text(b.build_{kind}(sys.argv[1]))"
        )
        result = subprocess.run(
            [sys.executable, "-c", hook, str(out), str(answer)],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        built[kind] = out / answer.read_text()
    return built


def test_the_wheel_and_the_sdist_hold_every_package_file(dists):
    kernel_files = [f"nanokv_cli/engine/cpu/csrc/{p.name}" for p in build.sources()]
    assert any(f.endswith(".c") for f in kernel_files) and any(
        f.endswith(".h") for f in kernel_files
    )
    wheel = set(zipfile.ZipFile(dists["wheel"]).namelist())
    with tarfile.open(dists["sdist"]) as tar:
        root = tar.getnames()[0].split("/")[0]
        sdist = {n.removeprefix(root + "/") for n in tar.getnames()}
    for name, contents in (("wheel", wheel), ("sdist", sdist)):
        missing = sorted(set(kernel_files) - contents)
        assert not missing, f"the {name} lacks the kernel files {missing}"
        missing = sorted(set(package_files()) - contents)
        assert not missing, f"the {name} lacks {missing}"


@pytest.fixture(scope="module")
def reference_text(tmp_path_factory) -> str:
    """What the checkout's own install generates for the prompt."""
    result = nanokv(
        ["generate", PROMPT, "--max-tokens", 8, "--json"],
        cwd=tmp_path_factory.mktemp("run"),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]["text"]


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_an_installed_distribution_runs_generate_on_its_own_kernels(
    kind, dists, reference_text, tmp_path
):
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", dists[kind]],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    cache = tmp_path / "cache"  # empty: the kernels must be compiled from the install's sources
    env = {"NANOKV_CACHE_DIR": str(cache), "PYTHONPATH": ""}
    exe = [str(venv / "bin" / "nanokv")]

    result = nanokv(
        ["generate", PROMPT, "--max-tokens", 8, "--json"], env=env, cwd=tmp_path, exe=exe
    )
    assert result.returncode == 0, result.stderr
    assert "note" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert json.loads(result.stdout)[0]["text"] == reference_text
    assert len(list((cache / "kernels").glob("nanokv-*.so"))) == 1  # built from the install

    doctor = nanokv(["doctor", "--json"], env=env, cwd=tmp_path, exe=exe)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    site = venv / "lib"
    assert Path(checks["nanokv"]["detail"]["path"]).is_relative_to(site)
    assert Path(checks["kernel sources"]["detail"]["path"]).is_relative_to(site)
    kernels = checks["kernels"]["detail"]
    assert kernels["loaded"] and not kernels["built_now"]  # the library generate built
    assert Path(kernels["path"]).is_relative_to(cache)


# -- a start that explains itself -----------------------------------------------------------------


def one_line(stderr: str, prefix: str) -> str:
    """The one line of ``stderr`` that starts with ``prefix``, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    return lines[0]


def generate(tmp_path: Path, env: dict, *extra) -> subprocess.CompletedProcess:
    return nanokv(
        ["generate", PROMPT, "--max-tokens", 4, "--no-live", *extra],
        env={"NANOKV_CACHE_DIR": str(tmp_path / "cache"), **env},
        cwd=tmp_path,
    )


@pytest.mark.parametrize("where", ["not on PATH", "CC names none"])
def test_without_a_compiler_one_note_and_the_torch_path(where, tmp_path):
    if where == "not on PATH":
        # An empty folder as PATH (nanokv runs as sys.executable -m), CC unset.
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        env = {"PATH": str(bin_dir), "CC": ""}
    else:
        env = {"CC": str(tmp_path / "no-such-cc")}
    result = generate(tmp_path, env)
    assert result.returncode == 0, result.stderr
    note = one_line(result.stderr, "nanokv: note:")
    assert "no C compiler" in note and "slower" in note and "install gcc" in note
    assert result.stdout.strip()  # the text, from torch's kernels
    assert not (tmp_path / "cache" / "kernels").exists() or not list(
        (tmp_path / "cache" / "kernels").glob("*.so")
    )


def bad_isa_values() -> list[str]:
    usable = {v.name for v in build.usable_variants(build.cpu_features())}
    unusable = [v.name for v in build.VARIANTS if v.name not in usable]  # e.g. avx512 on AVX2
    return ["garbage", "x86-64-v4", "avx1024", *unusable]


@pytest.mark.parametrize("value", bad_isa_values())
def test_a_bad_cpu_isa_is_one_error_naming_the_valid_values(value, tmp_path):
    result = generate(tmp_path, {build.ISA_VARIABLE: value})
    assert result.returncode == 1, result.stderr
    line = one_line(result.stderr, "nanokv: error:")
    assert build.ISA_VARIABLE in line
    runs = line.split("run")[-1]  # "(this CPU runs a, b, c)" or "it can run a, b"
    for variant in build.usable_variants(build.cpu_features()):
        assert variant.name in runs, line
    doctor = nanokv(["doctor"], env={build.ISA_VARIABLE: value}, cwd=tmp_path)
    assert doctor.returncode == 1 and "fail  kernel variant" in doctor.stdout, doctor.stdout


def test_a_variant_name_is_read_in_any_case(tmp_path):
    best = build.usable_variants(build.cpu_features())[0].name
    result = generate(tmp_path, {build.ISA_VARIABLE: f" {best.upper()} "})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "note" not in result.stderr


@pytest.mark.parametrize("damage", ["empty file", "garbage", "library without the kernels"])
def test_a_broken_cached_library_is_rebuilt_not_reused(damage, tmp_path):
    env = {**os.environ, "NANOKV_CACHE_DIR": str(tmp_path / "cache")}
    where = (
        "from nanokv_cli.engine.cpu import build\n"
        "print(build.library_path(build.active_variant(), build.find_compiler()))"
    )
    path = Path(
        subprocess.run(
            [sys.executable, "-c", where], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    path.parent.mkdir(parents=True)
    if damage == "empty file":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\x7fELF" + os.urandom(4096))
    else:  # what the broken wheel produced: a valid library compiled from no kernels
        empty_c = tmp_path / "empty.c"
        empty_c.write_text("int nanokv_nothing;\n")
        subprocess.run([build.find_compiler(), "-shared", "-fPIC", "-o", path, empty_c], check=True)
    check = (
        "from nanokv_cli.engine.cpu import kernels, library\n"
        "s = library.status()\n"
        "assert s.lib is not None and s.built, s\n"
        "assert kernels.available()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    # The real library now sits where the broken one did.
    assert hasattr(ctypes.CDLL(str(path)), "paged_decode_f32")
    again = subprocess.run(  # and the next process takes it from the cache
        [sys.executable, "-c", check.replace("and s.built", "and not s.built")],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert again.returncode == 0, again.stderr


def test_no_sources_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path / "csrc")
    with pytest.raises(build.KernelBuildError, match=f"missing from {tmp_path / 'csrc'}"):
        build.sources()


@pytest.mark.parametrize("threads", [0, available_cpus() + 1, 1000])
def test_threads_beyond_the_cpus_are_refused_in_one_message(threads, tmp_path):
    result = generate(tmp_path, {}, "--threads", threads)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "--threads" in result.stderr
    expected = "greater than or equal to 1" if threads == 0 else f"use at most {available_cpus()}"
    assert expected in " ".join(result.stderr.split()), result.stderr


def proc_cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux reports CPU features there")
def test_doctor_reports_this_machine_truly(tmp_path):
    result = nanokv(["doctor", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and all(c["status"] != "fail" for c in checks.values())
    assert all(c["advice"] for c in checks.values() if c["status"] != "ok")
    # The variant, from /proc/cpuinfo read here rather than through nanokv's own parser.
    flags = proc_cpuinfo_flags()
    need512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}
    expected = (
        "avx512"
        if need512 <= flags
        else "avx2"
        if {"avx2", "fma", "f16c", "bmi2"} <= flags
        else "generic"
    )
    assert checks["kernel variant"]["detail"]["variant"] == expected
    assert set(checks["cpu"]["detail"]["features"]) <= flags
    assert ("avx512_bf16" in checks["cpu"]["detail"]["features"]) == ("avx512_bf16" in flags)
    assert checks["kernels"]["detail"]["loaded"]
    assert checks["threads"]["detail"]["affinity"] == len(os.sched_getaffinity(0))
    assert Path(checks["default model"]["detail"]["path"]).stat().st_size == 98_362_432
    assert checks["C compiler"]["detail"]["path"] == shutil.which(os.environ.get("CC") or "cc")
    text = nanokv(["doctor"], cwd=tmp_path)
    assert text.returncode == 0
    lines = [line for line in text.stdout.splitlines() if not line.lstrip().startswith("->")]
    assert [line.split()[0] for line in lines] == [c["status"] for c in report["checks"]]
