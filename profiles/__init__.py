"""Profiles bundled with umopt, addressable by name (see umopt.formats.profile.bundled_profiles)."""
