"""The files umopt reads and writes: profiles (what each stage costs) and schedules (who runs
which chunk when). docs/formats.md is their contract."""

from .profile import (
    PROFILE_FORMAT,
    Profile,
    bundled_profiles,
    load_profile,
    save_profile,
)
from .schedule import (
    SCHEDULE_FORMAT,
    Schedule,
    check_against_profile,
    load_schedule,
    make_schedule,
    save_schedule,
    validate_ops,
)

__all__ = [
    "PROFILE_FORMAT",
    "Profile",
    "bundled_profiles",
    "load_profile",
    "save_profile",
    "SCHEDULE_FORMAT",
    "Schedule",
    "check_against_profile",
    "load_schedule",
    "make_schedule",
    "save_schedule",
    "validate_ops",
]
