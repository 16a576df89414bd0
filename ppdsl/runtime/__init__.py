"""The runtime that generated rank programs call."""
