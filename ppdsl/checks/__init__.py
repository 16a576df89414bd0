"""Static checks on the schedule IR, one module per property."""
