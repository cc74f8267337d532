"""Cache service: vision embeddings by exact key and by similarity, behind
``qwenvl.cache.v1.CacheService``."""
