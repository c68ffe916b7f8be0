from array import array
from enum import Enum, auto
from itertools import count

from .sampling_params import SamplingParams

# The token ids a prompt may hold without a vocabulary to check them against (a dry run): what
# a trace records (int32 prompts), far past the largest vocabulary (a few hundred thousand).
TOKEN_ID_RANGE = (0, 2**31)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, where it stands, and its page table (``block_table``).

    The block size is an argument, not a class variable, so two engines with different
    block sizes can live in one process.
    """

    counter = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams = SamplingParams(),
        block_size: int = 256,
        seq_id: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        # An engine numbers its own requests from 0 (so a run's request ids are stable); a
        # sequence made on its own takes the next process-wide id.
        self.seq_id = next(Sequence.counter) if seq_id is None else seq_id
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        # An int64 ``array`` is kept as one (synthesized trace prompts: no per-token objects);
        # anything else becomes a list.
        self.token_ids = token_ids[:] if isinstance(token_ids, array) else list(token_ids)
        self.last_token = self.token_ids[-1] if self.token_ids else None
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table: list[int] = []
        # (source block, destination block, tokens): K/V the block manager found in another
        # block, for the runner to copy before this sequence's next forward pass.
        self.kv_copy: tuple[int, int, int] | None = None
        # Chained hashes of this sequence's full blocks, filled lazily; full blocks never
        # change, so the cache is never invalidated (only extended).
        self.block_hashes: list[int] = []
        self.num_prefix_hit_tokens = -1  # prompt tokens served from the cache at first admission
        self.num_prefix_restored_tokens = 0  # ...of them, restored from the second tier (kv_tier)
        self.finish_reason: str | None = None
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.top_k = sampling_params.top_k
        self.top_p = sampling_params.top_p
        self.seed = sampling_params.seed

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_cached_tokens={self.num_cached_tokens}, "
            f"block_table={self.block_table})"
        )

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1
