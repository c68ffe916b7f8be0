"""scripts/check/import_graph.py and scripts/check/call_path.py: the checker finds what it claims to on a
package made for it, and nanokv_cli has no cycle, no upward arrow, no oversized module or
function, and no call back into a module the constructor has left (issue 30)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check" / "import_graph.py"


def run_graph(*args: str) -> tuple[int, dict]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def arrows(report: dict) -> set[tuple[str, str, str]]:
    return {(e["source"], e["target"], e["kind"]) for e in report["edges"]}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def tests_folder(tmp_path: Path) -> Path:
    """A tests folder with nothing to find in it."""
    return write(tmp_path / "tests", {"conftest.py": ""})


def test_finds_cycles_upward_arrows_and_long_code(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(85))
    pkg = write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "cli.py": "",
            "engine/__init__.py": "",
            "engine/a.py": "from . import b\nimport rich.console\n",
            # The way back only inside a function and for typing: still a cycle.
            "engine/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .a import A\n"
                "def f():\n    from pkg.engine import a\n"
            ),
            "engine/cpu/__init__.py": "",
            "engine/cpu/k.py": "from ..layers.x import y\nfrom ..gguf_file import z\n",
            "engine/model/gguf_file.py": "",
            "engine/layers/__init__.py": "",
            "engine/layers/x.py": "from ..cpu import k\n",
            "engine/up.py": "from ..cli import main\n",
            "views/__init__.py": "",
            "views/v.py": "def g():\n    from .. import cli\n",
            "big.py": "def long():\n" + long_body + "\n" * 600,
        },
    )
    code, report = run_graph("--root", str(pkg), "--tests", str(tests_folder(tmp_path)))
    assert code == 1
    found = arrows(report)
    assert ("pkg.engine.b", "pkg.engine.a", "typing") in found
    assert ("pkg.engine.b", "pkg.engine.a", "function") in found
    cycles = [{e["source"] for e in group} for group in report["cycles"]]
    assert sorted(map(sorted, cycles)) == [
        ["pkg.engine.a", "pkg.engine.b"],
        ["pkg.engine.cpu.k", "pkg.engine.layers.x"],
    ]
    upward = {(e["source"], e["target"]) for e in report["upward"]}
    assert upward == {
        ("pkg.engine.cpu.k", "pkg.engine.layers.x"),
        ("pkg.engine.up", "pkg.cli"),
        ("pkg.views.v", "pkg.cli"),
    }  # cpu -> gguf_file is allowed: the format sits below the packed weights
    assert [(e["source"], e["target"]) for e in report["forbidden_libraries"]] == [
        ("pkg.engine.a", "rich")
    ]
    assert [m["path"] for m in report["big_modules"]] == ["pkg/big.py"]
    assert [(f["name"], f["lines"]) for f in report["long_functions"]] == [("long", 86)]

    _, module_level = run_graph("--root", str(pkg), "--module-level")
    assert [{e["source"] for e in g} for g in module_level["cycles"]] == [
        {"pkg.engine.cpu.k", "pkg.engine.layers.x"}
    ]


def test_a_clean_package_passes(tmp_path):
    pkg = write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "cli.py": "from .engine import a\n\n\ndef main():\n    return a\n",
            "engine/__init__.py": "",
            "engine/a.py": "",
        },
    )
    tests = write(
        tmp_path / "tests",
        {"conftest.py": "from support.x import y\n", "support/x.py": "y = 1\n", "test_a.py": ""},
    )
    code, report = run_graph("--root", str(pkg), "--tests", str(tests))
    assert code == 0
    assert report["test_imports"] == [] and report["unused_imports"] == []
    assert arrows(report) == {("pkg.cli", "pkg.engine.a", "module")}


def test_finds_test_modules_imported_by_other_test_files(tmp_path):
    pkg = write(tmp_path / "pkg", {"__init__.py": ""})
    tests = write(
        tmp_path / "tests",
        {
            "conftest.py": "",
            "test_serve.py": "class Server:\n    pass\n",
            "test_top.py": "import sys\nfrom test_serve import Server\n",
            "test_late.py": "def test_x():\n    import test_serve\n",
            "test_dotted.py": "from tests.test_serve import Server\nfrom tests import test_top\n",
            "test_fine.py": "from support.servers import KEY\nimport testing_helpers\n",
            "support/__init__.py": "",
            "support/servers.py": "from test_serve import Server\n",  # support is no way round
        },
    )
    code, report = run_graph("--root", str(pkg), "--tests", str(tests))
    assert code == 1
    found = {(t["path"], t["target"], t["line"]) for t in report["test_imports"]}
    assert found == {
        ("tests/test_top.py", "test_serve", 2),
        ("tests/test_late.py", "test_serve", 2),
        ("tests/test_dotted.py", "test_serve", 1),
        ("tests/test_dotted.py", "test_top", 2),
        ("tests/support/servers.py", "test_serve", 1),
    }


def test_finds_imports_a_module_does_not_use(tmp_path):
    pkg = write(
        tmp_path / "pkg",
        {
            # The package root and the seed's public paths may re-export.
            "__init__.py": "from .impl import thing\n__all__ = ['thing']\n",
            "engine/__init__.py": "",
            "engine/block_manager.py": "from .core.blocks import Block\n",
            "engine/sequence.py": "from .core.seq import Sequence\n",
            "engine/sampling_params.py": "from .core.params import SamplingParams\n",
            "impl.py": "def thing():\n    return 1\n",
            # A facade: names imported only to be offered under another path.
            "facade.py": "from .impl import thing\nfrom . import impl as other\n__all__ = ['thing']\n",
            "sub/__init__.py": "from ..impl import thing\n",
            "lazy.py": "from __future__ import annotations\nimport os\n\n\ndef f():\n"
            "    import json\n    return 1\n",
            # Used: in code, as a module's attribute, in a string annotation, under TYPE_CHECKING.
            "used.py": (
                "from __future__ import annotations\n"
                "import os.path\n"
                "from typing import TYPE_CHECKING\n"
                "from .impl import thing\n"
                "if TYPE_CHECKING:\n    from .impl import Thing, Other\n"
                "__all__ = ['f']\n\n\n"
                "def f(x: 'Thing', y: list['Other']) -> None:\n"
                "    return thing(os.path.join('a', 'b'))\n"
            ),
        },
    )
    code, report = run_graph("--root", str(pkg), "--tests", str(tests_folder(tmp_path)))
    assert code == 1
    found = {(u["path"], u["name"], u["in_all"]) for u in report["unused_imports"]}
    assert found == {
        ("pkg/facade.py", "thing", True),
        ("pkg/facade.py", "other", False),
        ("pkg/sub/__init__.py", "thing", False),
        ("pkg/lazy.py", "os", False),
        ("pkg/lazy.py", "json", False),
    }


def test_nanokv_has_no_cycle_upward_arrow_or_oversized_code():
    code, report = run_graph()
    print(subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True).stdout)
    engine = "nanokv_cli.engine.model."
    found = arrows(report)
    # tokenizer renders through chat_template; chat_template imports only the errors module.
    assert (engine + "tokenizer", engine + "chat_template", "module") in found
    assert not any(s == engine + "chat_template" and t == engine + "tokenizer" for s, t, _ in found)
    assert code == 0 and report["cycles"] == [] and report["upward"] == []
    # Python and C alike (issue 30): no module over 600 lines, no function over 80.
    assert report["big_modules"] == []
    assert report["long_functions"] == []


def test_no_test_imports_a_test_and_nanokv_imports_only_what_it_uses():
    """Tests share through tests/support/ and conftest.py, never through each other; and no
    module of nanokv_cli imports a name only to offer it under another path (issue 43)."""
    _, report = run_graph()
    assert report["test_imports"] == [], report["test_imports"]
    assert report["unused_imports"] == [], report["unused_imports"]


def test_following_llm_into_the_runner_returns_to_no_module_it_has_left():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check" / "call_path.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    path = json.loads(result.stdout)
    assert path["reentries"] == []
    entered = {m["module"]: m["entered"] for m in path["modules"]}
    # The runner is entered once, from the LLM, after the plan was resolved; its plan, cache
    # and attention back end are modules of their own.
    assert entered["engine/runner/model_runner.py"] == 1
    order = [m["module"] for m in path["modules"]]
    assert order.index("engine/runner/run_plan.py") < order.index("engine/runner/model_runner.py")
