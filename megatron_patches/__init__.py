"""Megatron-Core integration (imports megatron.core; lands with the Megatron issue)."""
