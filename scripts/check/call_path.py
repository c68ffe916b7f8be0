"""Follow ``LLM(config=...)`` through nanokv_cli's code: which modules it enters, in order, and
every call that returns into a module already left (a callback up the stack).

A reader following the constructor goes down a tree of calls: the LLM, the run plan, the
loader, the runner, the model, the cache. A call from module B into module A while A is below B
on the stack (an override the base class calls midway, a lambda handed down and called back)
sends that reader back into a room already left. This script traces the construction with
``sys.settrace`` and lists each such re-entry, with the chain of modules it came through.

    python scripts/check/call_path.py                  # the default model
    python scripts/check/call_path.py --model DIR      # a Hugging Face folder or .gguf file
    python scripts/check/call_path.py --json

Exit status 1 when there is a re-entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# This checkout: the nearest folder above holding pyproject.toml (no import of scripts/common.py:
# what it imports would be entered before the path is followed).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
sys.path.insert(0, str(ROOT))

import nanokv_cli  # noqa: E402

PACKAGE = Path(nanokv_cli.__file__).resolve().parent


def _module(frame) -> str | None:
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else None


def follow(build) -> dict[str, Any]:
    """Call ``build()`` under a tracer: the nanokv_cli modules entered (in order of first
    entry, with how often each was entered from another module) and the re-entries."""
    entered: Counter[str] = Counter()
    order: list[str] = []
    reentries: Counter[tuple[str, str]] = Counter()

    def tracer(frame, event, _arg):
        if event != "call" or (module := _module(frame)) is None:
            return None
        chain = []
        caller = frame.f_back
        while caller is not None:
            if (m := _module(caller)) is not None:
                chain.append(m)
            caller = caller.f_back
        if chain and chain[0] != module:
            if module not in entered:
                order.append(module)
            entered[module] += 1
            if module in chain:  # below a module it has since left
                path = " <- ".join([module, *chain[: chain.index(module) + 1]])
                reentries[(f"{module}:{frame.f_code.co_name}", path)] += 1
        return None

    sys.settrace(tracer)
    try:
        build()
    finally:
        sys.settrace(None)
    return {
        "modules": [{"module": m, "entered": entered[m]} for m in order],
        "reentries": [
            {"call": call, "through": path, "count": n} for (call, path), n in reentries.items()
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf [default model]")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from nanokv_cli.engine.config import EngineConfig
    from nanokv_cli.llm import LLM

    result = follow(lambda: LLM(args.model, config=EngineConfig(num_blocks=16, device="cpu")))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("modules entered from another module, in order of first entry:")
        for m in result["modules"]:
            print(f"  {m['module']}: {m['entered']}x")
        print(f"\nre-entries into a module already left ({len(result['reentries'])}):")
        for r in result["reentries"]:
            print(f"  {r['call']} ({r['count']}x): {r['through']}")
    return 1 if result["reentries"] else 0


if __name__ == "__main__":
    sys.exit(main())
