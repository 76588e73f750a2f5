"""The replica pool: every engine replica the gateway routes across, their readiness, pickers and drains."""
