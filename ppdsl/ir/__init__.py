"""The compiler's intermediate representations: `schedule` (per-device compute
order) and `rank` (per-rank programs with transfers)."""
