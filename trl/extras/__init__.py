"""Optional extras: profiling helpers and other utilities that the trainers use."""
