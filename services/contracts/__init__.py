"""Contracts shared by two services: each side imports them from here, never from the other."""
