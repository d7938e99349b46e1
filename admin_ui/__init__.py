"""Templates and static files of the web UI, served by the platform at /ui."""
