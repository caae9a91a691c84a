"""corral scheduler."""
