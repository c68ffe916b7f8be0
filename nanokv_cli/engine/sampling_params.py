from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # User input reaches here straight from flags and prompt files: fail with a sentence.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
