"""Lowering: the schedule IR becomes rank programs (`lower`: the transfers each
pass needs), then receives move into earlier exchanges where the plain lowering
would deadlock under blocking exchanges (`early_receives`)."""
