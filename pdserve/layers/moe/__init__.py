"""Mixture-of-experts layers."""
