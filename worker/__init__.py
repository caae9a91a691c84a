"""corral worker."""
