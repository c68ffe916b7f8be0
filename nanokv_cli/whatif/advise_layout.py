"""advise's prompt-layout findings (``layout.py``), each measured by a dry run of the grid.

``find_layout_findings`` asks its ``measure`` for the cached prompt tokens of the prompts as
given and of each finding's rewrite (or of the prompts at another block size). Here that is the
dry run advise runs for every setting: the same engine settings, cache size and arrivals, on
the requests the rewrite makes (``PromptTexts.requests``). So that those runs go with the
grid's (in one ``evaluate``, in its process pool), the findings are looked for twice: once to
learn which runs they ask for (``points``), and once more, when the runs are done, to rank
them by what the runs measured (``findings``). The second look asks for the same runs: the
detectors depend on the prompts alone.

The block size the findings are looked for at is the engine's grain of reuse: the block size
under whole-block matching, and one token under token-granular matching (the default), which
serves a shared prefix to the token (a part block by copying), so that a fix regaining less
than a block still shows, and no smaller block size is suggested where none is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from ..engine.config import EngineConfig
from .advise_grid import Point, block_size_point, dry_run
from .advise_workload import Workload
from .layout import Finding, Prompt, find_layout_findings

MAX_FINDINGS = 5  # findings listed, gain or none
ALL = 99  # the first look keeps every finding: their ranks are not known yet


@dataclass
class Layout:
    """The layout findings of one workload at ``base``, and the runs that measure them."""

    workload: Workload
    base: EngineConfig

    def __post_init__(self) -> None:
        texts = self.workload.texts
        assert texts is not None and self.workload.decode is not None
        self.texts = texts
        self.given = _digest(texts.prompts)
        token = self.base.prefix_match == "token"
        self.grain = 1 if token else self.base.block_size  # the findings' block size
        self.inputs: dict[str, Any] = {}  # a rewrite's key -> its requests
        self.kinds: dict[str, str] = {}  # a rewrite's key -> the kind of finding it fixes
        self.measured: dict[tuple[str, int], dict[str, Any]] = {}

    def points(self, grid: list[Point]) -> list[Point]:
        """The runs the findings ask for that ``grid`` lacks (a rewrite at the settings now,
        or the prompts as given at another block size), with ``inputs`` for the rewrites."""
        found = self._find(lambda prompts, block_size: 0, ALL)
        have = {p.config for p in grid if p.input is None}
        out = []
        for f in found:
            if f.setting is not None:
                point = block_size_point(self.base, f.setting["block_size"])
                if point.config not in have:
                    have.add(point.config)
                    out.append(point)
            else:
                key = _digest(f.rewritten)
                if key not in self.inputs:
                    self.inputs[key] = self.texts.requests(f.rewritten)
                    self.kinds[key] = f.kind
                    label = f"layout: {f.kind}"
                    out.append(Point("layout", label, f.fix, self.base, input=key))
        return out

    def findings(self, points: list[Point], runs: list[dict[str, Any]]) -> list[Finding]:
        """The findings, each with its gain measured by the runs (of ``points``), ranked."""
        for p, run in zip(points, runs):
            key = p.input or self.given
            if p.config == self.base:
                self.measured[(key, self.grain)] = run
            elif p.config == self._config(p.config.block_size):
                self.measured[(key, p.config.block_size)] = run
        return self._find(self._measure, MAX_FINDINGS)

    def run_of(self, finding: Finding) -> dict[str, Any]:
        """The run that measured a finding's fix."""
        if finding.setting is not None:
            return self.measured[(self.given, finding.setting["block_size"])]
        return self.measured[(_digest(finding.rewritten), self.grain)]

    def _find(self, measure, most: int) -> list[Finding]:
        w = self.workload
        return find_layout_findings(
            self.texts.prompts, self.texts.encode, w.decode, self.grain, measure, most
        )

    def _config(self, block_size: int) -> EngineConfig:
        """The settings a measure at ``block_size`` runs: now's at the findings' block size,
        else that block size with the same cache in tokens (as the grid's block-size runs)."""
        if block_size == self.grain:
            return self.base
        return block_size_point(self.base, block_size).config

    def _measure(self, prompts: list[Prompt], block_size: int) -> int:
        key = (_digest(prompts), block_size)
        if key not in self.measured:  # not asked for the first time: run it now
            requests = self.workload.requests if key[0] == self.given else None
            requests = requests or self.texts.requests(prompts)
            self.measured[key] = dry_run(requests, self._config(block_size))
        return self.measured[key]["cache_hits"]


def _digest(prompts: list[Prompt] | None) -> str:
    """A rewrite's name: the digest of its prompts (equal prompts, one run)."""
    h = xxhash.xxh3_128()
    for p in prompts or ():
        h.update(repr(p).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def finding_record(f: Finding, labels: list[Any]) -> dict[str, Any]:
    """A finding as advise's JSON carries it (the measured run's numbers go beside it)."""
    i, j = f.pair
    return {
        "kind": f.kind,
        "cause": f.cause,
        "fix": f.fix,
        "prompts": len(f.prompts),
        "example": [labels[i], labels[j]],
        "part_at": f.part_at,
        "left": f.left,
        "right": f.right,
        "tokens_lost": f.tokens_lost,
        "gain_tokens": f.gain_tokens,
        "setting": f.setting,
    }
