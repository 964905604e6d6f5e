"""Pixel verification of candidate copy pairs."""
