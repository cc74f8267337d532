"""Reference run: vLLM fed precomputed image embeddings directly, greedy; prints JSON tokens.

Usage: python tests/vllm_embeds.py MODEL_DIR MAX_TOKENS JOBS_JSON
JOBS_JSON: [{"embeds": path of a torch.save'd [tokens, width] tensor, "grid": [t, h, w],
"prompt": chat-template text with one <|image_pad|>}, ...]
The engine runs in the checkpoint's own dtype (``dtype="auto"``, as the decoder service
does through ``splitvl up``) with ``enable_mm_embeds``. A script of its own because vLLM
starts its engine core with spawn (needs a __main__ guard).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams

    model, max_tokens, jobs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(
        model=model,
        dtype="auto",
        enforce_eager=True,
        max_model_len=4096,
        seed=0,
        enable_mm_embeds=True,
        # As the decoder service sets them (decoder_service.__main__): a non-zero image
        # count (with 0 the engine drops deepstack, FACTS.md) and its CPU block size.
        limit_mm_per_prompt={"image": 8, "video": 0},
        block_size=32,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [
        {
            "prompt": job["prompt"],
            "multi_modal_data": {
                "image": {
                    "image_embeds": torch.load(job["embeds"]),
                    "image_grid_thw": torch.tensor([job["grid"]], dtype=torch.long),
                }
            },
        }
        for job in jobs
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
