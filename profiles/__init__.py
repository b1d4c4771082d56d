"""Profiles bundled with umopt, addressable by name (see umopt.profile.bundled_profiles)."""
