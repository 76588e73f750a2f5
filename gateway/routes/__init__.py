"""HTTP routes; each module exports `router`. Only `gateway.app` imports this package."""
