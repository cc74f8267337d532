"""How long the decoder's own preparation of a request takes, without the engine.

The decoder renders the chat template and tokenises the prompt twice per request (the
prompt, and the same messages with blank texts for the control-token check,
``decoder_service.prepare.Preparer``); this times those four calls with the checkpoint's
own tokenizer, one image part and one text part, and prints the median, min and max.

    python scripts/measure_decoder_prep.py MODEL_DIR [--trials 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--trials", type=int, default=50)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)

    def user(text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]

    times = []
    for _ in range(args.trials + 10):  # 10 warm-up trials
        t = time.perf_counter()
        for messages in (user("Describe this image."), user("")):
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            tok(prompt, add_special_tokens=False)
        times.append((time.perf_counter() - t) * 1000)
    times = times[10:]
    print(
        f"render + tokenize, twice: median {statistics.median(times):.2f} ms, "
        f"min {min(times):.2f}, max {max(times):.2f} ({args.trials} trials)"
    )


if __name__ == "__main__":
    main()
