"""Bagel compression package."""
