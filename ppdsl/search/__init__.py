"""`ppdsl search`: find building blocks and orders under a memory budget."""
