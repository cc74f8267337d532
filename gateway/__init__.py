"""Gateway: splitvl's public ``qwenvl.gateway.v1.GatewayService``."""
