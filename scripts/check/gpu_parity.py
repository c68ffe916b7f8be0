"""Greedy parity with transformers, and the answer staying the same alone, batched and after
cache hits, on one device: the correctness steps of ``scripts/check/gpu_check.sh`` (issue 44).

Tiny random Llama and Qwen3 models (tests/support/models.py, seeded), four prompts of 7 to 100
token ids. For each dtype and block size, nanokv answers every prompt alone, then all four in
one batch (their prompts now hit the prefix cache); transformers answers each alone on the same
device. Exit status 1 when a float32 answer differs from transformers' or any answer changes
with its batch or a cache hit; reduced precision's parity with transformers is reported, not
required (a tiny random model's near-ties can part in bfloat16).

    python scripts/check/gpu_parity.py --device cuda                        # the default back end
    TRITON_INTERPRET=1 python scripts/check/gpu_parity.py --device cpu --attention-backend triton
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: common.py

import torch  # noqa: E402
from common import test_support  # noqa: E402

from nanokv_cli import LLM, SamplingParams  # noqa: E402
from nanokv_cli.engine.config import ATTENTION_BACKENDS  # noqa: E402

# The tests' seeded tiny models, built the same way here.
make_tiny_model = test_support("models").make_tiny_model

PROMPT_LENGTHS = (7, 30, 61, 100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--block-sizes", default="16,256")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--archs", default="llama,qwen3")
    p.add_argument("--models", default=None, help="folder for the tiny models (default: temp)")
    return p.parse_args()


def prompts() -> list[list[int]]:
    return [[(i * 37 + n * 11) % 290 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


def transformers_greedy(folder: Path, dtype: torch.dtype, device: str, n: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    answers = []
    with torch.inference_mode():
        for p in prompts():
            ids = torch.tensor([p], device=device)
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            answers.append(out[0, len(p) :].tolist())
    return answers


def nanokv_answers(folder: Path, args, dtype: str, block_size: int) -> tuple[list, list, int]:
    """(each prompt alone, all four batched after them, prompt tokens the batch hit)."""
    llm = LLM(
        str(folder),
        device=args.device,
        dtype=dtype,
        attention_backend=args.attention_backend,
        block_size=block_size,
        num_blocks=-(-512 // block_size) * 8,
        max_model_len=512,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    alone = [llm.generate(p, greedy)[0]["token_ids"] for p in prompts()]
    batched = llm.generate(prompts(), greedy)
    hits = sum(o["num_cached_tokens"] for o in batched)
    return alone, [o["token_ids"] for o in batched], hits


def main() -> int:
    args = parse_args()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.models or tmp)
        for arch in args.archs.split(","):
            folder = make_tiny_model(arch, root / arch)
            for dtype in args.dtypes.split(","):
                reference = transformers_greedy(
                    folder, getattr(torch, dtype), args.device, args.new_tokens
                )
                for block_size in map(int, args.block_sizes.split(",")):
                    alone, batched, hits = nanokv_answers(folder, args, dtype, block_size)
                    same = sum(a == r for a, r in zip(alone, reference))
                    invariant = alone == batched and hits > 0
                    required = dtype == "float32"
                    ok = invariant and (same == len(reference) or not required)
                    failures += not ok
                    print(
                        f"{'ok  ' if ok else 'FAIL'} {arch} {dtype} block {block_size}: "
                        f"transformers parity {same}/{len(reference)}"
                        f"{'' if required else ' (reported)'}; alone = batched after "
                        f"{hits} cache-hit tokens: {'yes' if alone == batched else 'NO'}",
                        flush=True,
                    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
