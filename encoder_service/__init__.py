"""Encoder service: Qwen3-VL's vision tower behind ``qwenvl.encoder.v1.EncoderService``."""
