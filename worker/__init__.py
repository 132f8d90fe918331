"""Bagel worker package."""
