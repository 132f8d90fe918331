"""Bagel models package."""
