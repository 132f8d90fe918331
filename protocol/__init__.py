"""Bagel protocol package."""
