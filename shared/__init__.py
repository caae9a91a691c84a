"""What every corral process imports: settings, errors, storage and the Celery app."""
