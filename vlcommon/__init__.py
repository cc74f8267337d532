"""Code the splitvl services share: server bootstrap, errors, tensor codec, telemetry,
settings, and the one image pipeline (decode, resize plan, keys, descriptors)."""
