"""splitvl: Qwen3-VL served as gRPC microservices (gateway, encoder, cache, decoder)."""

__version__ = "0.1.0"
