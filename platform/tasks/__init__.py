"""Background work: the billing export and the Celery app that runs it.

``make_celery(settings)`` builds the app (in-process when no broker is configured);
``loramux.platform.tasks.worker`` is the module ``celery -A`` loads in worker processes.
"""
