"""Reference run: vLLM on raw, already sampled video frames (its own ViT), greedy.

Usage: python tests/vllm_raw_video.py MODEL_DIR MAX_TOKENS JOBS_JSON
JOBS_JSON: [{"prompt": chat-template text, "images": [path, ...],
             "videos": [{"frames": path.npy, "metadata": {...}}, ...]}, ...]
Each video's frames (uint8 [frames, height, width, 3]) are those splitvl's gateway kept
and resized; its metadata (fps, frames_indices, total_num_frames, do_sample_frames=False)
gives vLLM's Qwen3-VL processor the timestamps. Prints one ``TOKENS`` JSON line.
A script of its own because vLLM starts its engine core with spawn (a __main__ guard).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    model, max_tokens, jobs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        seed=0,
        limit_mm_per_prompt={"image": 2, "video": 2},
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = []
    for job in jobs:
        data: dict[str, object] = {}
        if job.get("images"):
            data["image"] = [Image.open(p).convert("RGB") for p in job["images"]]
        if job.get("videos"):
            data["video"] = [(np.load(v["frames"]), v["metadata"]) for v in job["videos"]]
        prompts.append(
            {
                "prompt": job["prompt"],
                "multi_modal_data": data,
                # The frames are sampled and resized already: the processor keeps them.
                "mm_processor_kwargs": {"do_resize": False, "do_sample_frames": False},
            }
        )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
