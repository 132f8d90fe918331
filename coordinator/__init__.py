"""Bagel coordinator package."""
