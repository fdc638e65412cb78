"""Contracts shared by every tier: settings, Redis key names, wire messages."""
