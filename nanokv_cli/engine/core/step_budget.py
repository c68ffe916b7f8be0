"""How many prompt tokens a step may take while sequences are decoding (stall-free batching).

A step's length is every decoding stream's inter-token latency. Under one fixed token budget
(``max_num_batched_tokens``) a burst of prompts makes each step last as long as thousands of
prompt tokens take on this machine: seconds on a CPU, during which every running stream is
frozen. Sarathi-Serve's answer is a budget chosen from a latency target. What a prompt token
costs differs by CPU, threads, model, batch and load, so the budget is measured as the run
goes: after each step that carried both decodes and prompt tokens, the prompt tokens that would
have made it last exactly the target are estimated from the step's own time (cost taken as
proportional to its prompt tokens), and the next such step takes that many. The estimate moves
at most 2x per step, so one slow step (another process, a decode program being recorded) does
not swing it.

Never fewer than ``min_prompt_tokens`` (the oldest waiting prompt always progresses, even
where the decodes alone exceed the target) and never more than the fixed budget. Steps
without decodes are not limited: nobody is waiting for a token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepBudget:
    """Prompt tokens per step under ``target_s`` while sequences decode."""

    target_s: float
    min_prompt_tokens: int = 16
    # Before a mixed step is measured: a chunk small enough not to stall anyone for long.
    prompt_chunk: float = 64.0

    def prompt_tokens(self, decode_rows: int, limit: int) -> int:
        """Prompt tokens this step may take beside ``decode_rows`` decodes (``limit``: the
        fixed budget left)."""
        if not decode_rows:
            return limit
        return max(0, min(limit, max(self.min_prompt_tokens, int(self.prompt_chunk))))

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step of ``decode_rows`` decodes and ``prompt_tokens`` prompt tokens took
        ``seconds``."""
        if not (decode_rows and prompt_tokens) or seconds <= 0:
            return
        fitting = prompt_tokens * self.target_s / seconds  # what would have taken the target
        if seconds <= self.target_s and prompt_tokens < self.prompt_chunk:
            return  # fewer prompt tokens were waiting than allowed: says nothing about more
        chunk = min(2 * self.prompt_chunk, max(self.prompt_chunk / 2, fitting))
        self.prompt_chunk = max(float(self.min_prompt_tokens), chunk)
