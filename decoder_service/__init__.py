"""Decoder service: vLLM continuous batching over precomputed Qwen3-VL image embeddings,
behind ``qwenvl.decoder.v1.DecoderService``."""
